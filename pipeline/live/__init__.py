"""Cost while it happens: provisional request costs and tenant spend, priced from each segment
as it closes by the hourly path's own attribution (`price`), published exactly once by a
long-running service (`service`); the hourly ledger supersedes them."""
