"""The ground floor's formats: what tracing, the collector, the analyzers and the dashboards all read
or write, with no import from any of them.

- :mod:`ranklens.formats.spool`: the spool segment codec and the one :class:`SpoolWriter`.
- :mod:`ranklens.formats.rows`: readers of the open ingest format (JSON Lines, Parquet).
- :mod:`ranklens.formats.flight_recorder`: PyTorch flight-recorder dumps (model, safe unpickler, parser).
- :mod:`ranklens.formats.kineto`: Kineto / torch.profiler traces (model, streaming parser).
- :mod:`ranklens.formats.process`: process helpers (pid namespace, is a local pid alive).
- :mod:`ranklens.formats.digest`: streamed content hashes of files (ingest ids).
- :mod:`ranklens.formats.records_gen`: the typed records, one frozen dataclass per table, generated
  from the schema by scripts/gen_records.py (import them from :mod:`ranklens.records`).

Modules here import nothing of ranklens but ``errors``, ``config``, ``schema`` and ``records``; the
package itself imports nothing, so the tracer loads only the spool codec it uses.
"""
