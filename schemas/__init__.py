"""What the project reads and writes, described once: the pools file (pydantic), the record
format, the tables, units and errors."""
