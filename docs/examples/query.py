"""Run the SQL on stdin against a warehouse file, read-only, and print the result.

.venv/bin/python docs/examples/query.py demo-run/warehouse.duckdb <<'SQL'
SELECT * FROM tenant_costs_daily;
SQL
"""

from __future__ import annotations

import sys

from pipeline.warehouse import connect_read_only

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: query.py WAREHOUSE.duckdb < query.sql")
    with connect_read_only(sys.argv[1]) as con:
        con.sql(sys.stdin.read()).show(max_width=150)
