"""Regenerates docs/ingest-format.md from ranklens.schema (tests check it is current).

python scripts/gen_ingest_doc.py > docs/ingest-format.md
"""

from __future__ import annotations

from ranklens.schema import TABLES

INTRO = """# The open ingest format

`ranklens ingest FILE...` loads records written by any tool, not only by ranklens' tracer.
Each file holds records of **one table**, as JSON Lines or Parquet. Every file is read and
validated before anything is written: a malformed file is reported with its line (JSONL) or
row (Parquet) and the field, the command exits with code 6, and the store is untouched.
Ingesting is idempotent: a file's rows carry an `ingest_id` hashed from its table and content,
and a file whose rows the store already holds (under any name) is skipped and said so; a file
the store holds in part (an ingest interrupted between blocks) is discarded and written again.
Kineto traces and flight-recorder dumps are stamped the same way (from their content, job and
attempt). Into the embedded store, the question "which of these does the store hold?" is answered
from its Parquet parts' footers (each written batch is one `ingest_id`), so an ingest never starts
chDB: `ranklens ingest` of 200,000 collectives (47 MB of JSONL) peaks at ~225 MB of memory rather
than ~490 MB.

## JSON Lines

One JSON object per line; keys are column names. An optional first line names the table:

```json
{"ranklens": "records", "version": 1, "table": "collectives"}
{"job_id": "llama-run3", "rank": 0, "pg": "0", "seq": 1, "op": "all_reduce", "nbytes": 4194304, "step": 12, "enter_ns": 1790000000000000000, "end_ns": 1790000000004000000}
{"job_id": "llama-run3", "rank": 1, "pg": "0", "seq": 1, "op": "all_reduce", "nbytes": 4194304, "step": 12, "enter_ns": 1790000000003000000, "end_ns": 1790000000004000000}
```

Which table a file belongs to comes from, in order: `--table`, the header line (Parquet: the
schema metadata key `ranklens.table`), or the first word of the file name (`collectives.jsonl`,
`steps-rank3.parquet`). Unknown keys are an error (a typo must not silently lose data); absent
optional columns take their default. This is also the format of the tracer's spool segments.

## Parquet

Columns named like the table's columns, of types that convert safely (e.g. int32 into Int64).
Nulls are rejected: use the default value instead.

## Conventions

- Times are integers, nanoseconds since the Unix epoch (`*_ns`); durations are `*_ns` too.
- "Unknown" is a default value (`-1`, `""`, `NaN`), never null.
- `(pg, seq)` identifies one collective across ranks: `pg` is the process-group name that every
  member uses (torch's group name), `seq` counts that group's collectives from 1 on each rank.
  Point-to-point ops use `pg` = `<group>/p2p:<src>-><dst>` with their own `seq` per direction.

## Tables
"""


def render() -> str:
    out = [INTRO]
    for t in TABLES.values():
        out.append(f"### `{t.name}`\n\n{t.doc[0].upper() + t.doc[1:]}.\n")
        out.append("| column | type | required | default | meaning |\n|---|---|---|---|---|")
        for c in t.columns:
            d = "" if c.required else repr(c.default_value()).replace("nan", "NaN")
            out.append(f"| `{c.name}` | {c.type} | {'yes' if c.required else ''} | {d} | {c.doc} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
