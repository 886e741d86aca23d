"""Where the pipeline keeps what it read and what it billed: the Parquet lake, the pipeline's
state and the warehouse, and an hour's publication into it."""
