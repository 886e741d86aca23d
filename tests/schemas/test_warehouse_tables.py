"""schemas/tables.py holds every warehouse and pipeline-state table's Arrow schema: each must be
exactly what sql/schema.sql and sql/pipeline_state.sql create."""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pytest

from pipeline.storage.warehouse import SCHEMA_SQL, STATE_SQL
from schemas.tables import PIPELINE_STATE_TABLES, WAREHOUSE_TABLES


def created_schemas(sql: str) -> dict[str, pa.Schema]:
    with duckdb.connect() as con:
        # TIMESTAMPTZ columns come out in the session's zone; the warehouse's is UTC.
        con.execute("SET TimeZone = 'UTC'")
        con.execute(sql)
        names = [r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()]
        schemas = {}
        for name in names:
            empty = con.execute(f"SELECT * FROM {name} LIMIT 0").arrow().read_all()
            nullable = {r[0]: r[2] == "YES" for r in con.execute(f"DESCRIBE {name}").fetchall()}
            schemas[name] = pa.schema(
                [
                    pa.field(
                        f.name,
                        pa.string() if f.type == pa.large_string() else f.type,
                        nullable=nullable[f.name],
                    )
                    for f in empty.schema
                ]
            )
        return schemas


@pytest.mark.parametrize(
    ("sql", "declared"),
    [(SCHEMA_SQL, WAREHOUSE_TABLES), (STATE_SQL, PIPELINE_STATE_TABLES)],
    ids=["warehouse", "pipeline_state"],
)
def test_every_table_schema_equals_the_sql(sql, declared) -> None:
    created = created_schemas(sql.read_text())
    assert sorted(created) == sorted(declared)
    for name, schema in declared.items():
        assert created[name].equals(schema), f"{name}:\n{created[name]}\n!=\n{schema}"
