"""Flight-recorder dumps: safe loading (pickle and JSON), ingest, and post-mortem analysis.

Real gloo dumps with ground truth live in tests/data/flight_recorder/ (see PROVENANCE.md); the
synthetic jobs below come from a tiny collective simulator, for faults the real data lacks.
"""

from __future__ import annotations

import collections
import json
import pickle
from collections import defaultdict
from pathlib import Path

import pytest

from ranklens.analyzers.hangs import analyze_flight_recorder, group_progress
from ranklens.collector.flight_recorder import infer_job_id, ingest_flight_recorder, load_dumps, to_collective_rows
from ranklens.errors import IngestError
from ranklens.formats.flight_recorder import FRDump, load_dump, parse_dump, safe_unpickle

DATA = Path(__file__).parent.parent / "data" / "flight_recorder"
SCENARIOS = ("healthy", "desync", "crashed_rank")
FORMATS = ("fr_pickle", "fr_json")


def _truth(scenario: str) -> dict:
    return json.loads((DATA / scenario / "ground_truth.json").read_text())


# ------------------------------------------------------------------------------------- real dumps


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_real_scenarios_match_ground_truth(scenario, fmt):
    truth = _truth(scenario)
    dumps = load_dumps(DATA / scenario / fmt)
    assert [d.rank for d in dumps] == truth["dumped_ranks"]
    findings = analyze_flight_recorder(dumps, job_id="j")
    if truth["kind"] == "healthy":
        assert findings == []
        return
    assert len(findings) == 1, [f.title for f in findings]
    f = findings[0]
    assert f.kind == truth["kind"]
    assert [s.rank for s in f.suspects] == truth["culprit_ranks"]
    ev = f.evidence
    assert ev["pg"] == {
        "name": truth["pg_name"],
        "desc": truth["pg"],
        "members": truth["process_groups"][truth["pg_name"]]["ranks"],
        "membership": "default group (world)",
    }
    assert ev["seq"] == truth["collective_seq_id"]
    assert ev["profiling_name"] == truth["collective"]
    assert ev["op"] == truth["collective"].split(":")[1]
    assert ev["input_sizes"] == truth["expected_input_sizes"]
    culprits = set(truth["culprit_ranks"])
    assert set(ev["missing"]) | set(ev["missing_dump"]) == culprits
    assert not culprits & set(ev["entered"]) and not culprits & set(ev["completed"])
    assert ev["action"] in ("restart_rank", "replace_node", "restart_job") and ev["action_reason"]
    assert str(truth["collective_seq_id"]) in f.title and truth["pg"] in f.title
    assert f.first_seen_step == -1 and f.severity.value == "critical"


def test_desync_reports_origin_not_downstream_symptom():
    f = analyze_flight_recorder(load_dumps(DATA / "desync" / "fr_pickle"))[0]
    assert f.title == (
        "rank 2 never entered all_reduce #35 of default_pg (it went on to all_reduce #19 of dp_0); "
        "ranks 0, 1, 3 are waiting in it"
    )
    ev = f.evidence
    assert ev["in_flight"] == [0, 1, 3] and ev["completed"] == []
    # dp_0 #19, which rank 0 never issued, is a consequence: evidence only, rank 0 not blamed.
    assert [(c["pg"]["desc"], c["seq"], c["missing"]) for c in ev["consequences"]] == [("dp_0", 19, [0])]
    culprit = ev["culprits"][0]
    assert culprit["in_flight"][0]["pg_desc"] == "dp_0" and culprit["in_flight"][0]["seq"] == 19
    assert culprit["expected_next"]["op"] == "all_reduce" and culprit["expected_next"]["pg_desc"] == "default_pg"
    assert ev["action"] == "restart_job"


def test_crash_says_what_cannot_be_known_and_blames_no_healthy_rank():
    dumps = load_dumps(DATA / "crashed_rank" / "fr_json")
    assert all(d.wrapped for d in dumps) and dumps[0].entries[0].collective_seq_id > 1
    f = analyze_flight_recorder(dumps)[0]
    ev = f.evidence
    assert [s.rank for s in f.suspects] == [1]
    assert ev["missing_dump"] == [1] and ev["missing_dumps"] == [1]
    assert ev["in_flight"] == [3] and ev["completed"] == [0, 2]  # failed, yet retired (gloo)
    assert "dump was lost" in ev["cannot_know"] and "dump was lost" in f.title
    assert ev["action"] == "replace_node"


def test_pickle_and_json_give_the_same_entries_and_findings():
    for scenario in SCENARIOS:
        p, j = load_dumps(DATA / scenario / "fr_pickle"), load_dumps(DATA / scenario / "fr_json")
        for a, b in zip(p, j, strict=True):
            assert (a.format, b.format) == ("pickle", "json")
            assert len(a.entries) == len(b.entries) and a.entries[0].frames and not b.entries[0].frames
            # JSON carries no stack frames; everything else is the same.
            assert [(e.pg_name, e.collective_seq_id, e.op, e.input_sizes, e.retired) for e in a.entries] == [
                (e.pg_name, e.collective_seq_id, e.op, e.input_sizes, e.retired) for e in b.entries
            ]
            assert a.pg_status == b.pg_status
        strip = ("dump", "stack", "waiting_stack")
        fa, fb = analyze_flight_recorder(p), analyze_flight_recorder(j)
        assert [(f.kind, f.title, f.id) for f in fa] == [(f.kind, f.title, f.id) for f in fb]
        for x, y in zip(fa, fb, strict=True):
            assert {k: v for k, v in x.evidence.items() if k not in (*strip, "culprits")} == {
                k: v for k, v in y.evidence.items() if k not in (*strip, "culprits")
            }


def test_gloo_quirks_are_read_as_documented():
    d = load_dump(DATA / "desync" / "fr_pickle" / "fr_trace_rank_2")
    assert d.rank == 2 and d.version == "2.10" and d.backend == "gloo" and d.pg_config == ()
    assert {s.pg_id for s in d.pg_status} == {"0", "1", "2"}  # local pg ids, not pg names
    last = d.entries[-1]
    assert (last.pg_name, last.pg_desc, last.collective_seq_id, last.op) == ("3", "dp_0", 19, "all_reduce")
    assert last.profiling_name == "gloo:all_reduce" and last.retired is False
    assert last.frames[-1].name == "<module>"


def test_group_progress_per_process_group():
    progress = group_progress(load_dumps(DATA / "desync" / "fr_pickle"))
    got = {(p.pg.desc, p.seq): (p.entered, p.in_flight, p.completed, p.missing) for p in progress}
    assert got == {
        ("default_pg", 35): ((0, 1, 3), (0, 1, 3), (), (2,)),
        ("dp_0", 19): ((2,), (2,), (), (0,)),
    }
    assert group_progress(load_dumps(DATA / "healthy" / "fr_json")) == []


# ------------------------------------------------------------------------- loading, bad input


def test_a_directory_with_both_formats_of_one_dump_reads_each_rank_once():
    """torch's recorder can write each dump as a pickle and as JSON side by side (the recorded sets
    keep both, in fr_pickle/ and fr_json/): the folder above them is one dump per rank, read once,
    from the pickle (JSON dumps have no stack frames)."""
    both = load_dumps(DATA / "desync")
    pickles = load_dumps(DATA / "desync" / "fr_pickle")
    assert [d.rank for d in both] == [0, 1, 2, 3]
    assert [d.source_path for d in both] == [d.source_path for d in pickles]
    assert all(e.frames for d in both for e in d.entries)
    assert group_progress(both) == group_progress(pickles)
    # the JSON copy named first: still the pickle's frames in the end
    assert [d.source_path for d in load_dumps([DATA / "desync" / "fr_json", DATA / "desync" / "fr_pickle"])] == [
        d.source_path for d in pickles
    ]


def test_two_different_dumps_of_one_rank_are_refused_clearly():
    with pytest.raises(IngestError, match=r"rank 0 already read from .*a different dump.*point at one"):
        load_dumps([DATA / "desync" / "fr_pickle", DATA / "healthy" / "fr_json" / "fr_trace_rank_0.json"])


def test_rank_from_the_dumps_own_field_else_the_file_name(tmp_path):
    obj = safe_unpickle((DATA / "healthy" / "fr_pickle" / "fr_trace_rank_1").read_bytes())
    (tmp_path / "dump").write_bytes(pickle.dumps({**obj, "rank": 7}))
    assert load_dump(tmp_path / "dump").rank == 7
    (tmp_path / "nccl_trace_rank_12").write_bytes(pickle.dumps(obj))
    assert load_dump(tmp_path / "nccl_trace_rank_12").rank == 12
    (tmp_path / "noname").write_bytes(pickle.dumps(obj))
    with pytest.raises(IngestError, match="cannot tell the rank"):
        load_dump(tmp_path / "noname")


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (lambda ok: ok[: len(ok) // 2], "truncated"),
        (lambda ok: b"\x80\x04garbage that is no pickle", "pickle"),
        (lambda ok: pickle.dumps(collections.OrderedDict(version="2.10", entries=[])), "collections"),
        (lambda ok: pickle.dumps(_Evil()), "refusing to load builtins.print"),
        (lambda ok: pickle.dumps({"version": "2.10", "entries": [], "x": {1, 2}}), "refusing a set"),
        (lambda ok: pickle.dumps({"version": "2.10"}), "field 'entries' is missing"),
        (lambda ok: pickle.dumps([1, 2]), "expected a dict"),
        (
            lambda ok: pickle.dumps({"version": "2.10", "entries": [{"process_group": ("0", "")}]}),
            r"entries\[0\].*field 'profiling_name' is missing",
        ),
    ],
    ids=["truncated", "garbage", "ordered-dict", "reduce-callable", "set", "no-entries", "list", "no-field"],
)
def test_bad_pickles_raise_ingest_error_naming_the_file(tmp_path, payload, message, embedded_store):
    good = DATA / "desync" / "fr_pickle"
    for f in good.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    bad = tmp_path / "fr_trace_rank_2"
    bad.write_bytes(payload(bad.read_bytes()))
    with pytest.raises(IngestError, match=message) as e:
        load_dumps(tmp_path)
    assert e.value.path == str(bad) and str(bad) in str(e.value)
    with pytest.raises(IngestError):
        ingest_flight_recorder(embedded_store, [tmp_path], job_id="bad")
    assert embedded_store.query("SELECT count() FROM collectives").scalar() == 0
    assert embedded_store.query("SELECT count() FROM process_groups").scalar() == 0


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda t: t[: len(t) // 3], "not valid JSON"),
        (lambda t: "]]] not json", "not valid JSON"),
        (lambda t: "", "empty file"),
        (lambda t: t.replace('"retired":false', '"retired":"no"'), "field 'retired' must be true or false"),
        (lambda t: t.replace('"collective_seq_id"', '"seq"', 1), "field 'collective_seq_id' is missing"),
    ],
    ids=["truncated", "garbage", "empty", "wrong-type", "missing-key"],
)
def test_bad_json_raises_ingest_error_naming_the_file(tmp_path, mangle, message):
    src = DATA / "desync" / "fr_json" / "fr_trace_rank_0.json"
    bad = tmp_path / "fr_trace_rank_0.json"
    bad.write_text(mangle(src.read_text()))
    with pytest.raises(IngestError, match=message) as e:
        load_dumps([bad])
    assert e.value.path == str(bad)


def test_safe_unpickle_visits_shared_objects_once():
    x: list = []
    for _ in range(200):  # 2**200 paths through 200 shared lists
        x = [x, x]
    assert safe_unpickle(pickle.dumps(x))[0] is not None


# ----------------------------------------------------------------------------------- ingest


def test_ingest_into_embedded_store(embedded_store):
    counts = ingest_flight_recorder(embedded_store, DATA / "desync" / "fr_pickle", job_id="fr-desync")
    assert counts == {"collectives": 4 * 63, "process_groups": 5}
    q = embedded_store.query
    # Every (pg, seq) of the default group up to 34 was entered by all four ranks; 35 by three.
    rows = q(
        "SELECT seq, count() AS n, groupArray(rank) AS r, min(op) AS op FROM collectives "
        "WHERE job_id = 'fr-desync' AND pg = '0' GROUP BY seq ORDER BY seq"
    ).to_pylist()
    assert [r["seq"] for r in rows] == list(range(1, 36))
    assert all(r["n"] == 4 for r in rows[:-1]) and sorted(rows[-1]["r"]) == [0, 1, 3]
    assert q("SELECT countDistinct(op) FROM collectives WHERE pg = '0' AND seq = 35").scalar() == 1
    # Not retired -> end_ns 0 (in flight); retired without a time (gloo) -> -1.
    assert q("SELECT count() FROM collectives WHERE end_ns = 0").scalar() == 4
    assert q("SELECT min(end_ns), max(end_ns) FROM collectives WHERE end_ns != 0").rows() == [(-1, -1)]
    assert q("SELECT DISTINCT op FROM collectives ORDER BY op").column("op").tolist() == [
        "all_gather",
        "all_reduce",
        "broadcast",
    ]
    assert q("SELECT nbytes, dtype FROM collectives WHERE pg = '0' AND seq = 35 LIMIT 1").rows() == [
        (520 * 4, "float32")
    ]
    groups = q("SELECT pg, name, ranks, backend FROM process_groups ORDER BY pg").rows()
    assert groups[0] == ("0", "default_pg", [0, 1, 2, 3], "gloo") and groups[3] == (
        "3",
        "dp_0",
        [0, 2],
        "gloo",
    )


def test_default_job_id_is_stable():
    dumps = load_dumps(DATA / "crashed_rank" / "fr_pickle")
    assert infer_job_id(dumps) == infer_job_id(load_dumps(DATA / "crashed_rank" / "fr_json"))
    assert infer_job_id(dumps).startswith("fr-2026")
    rows = to_collective_rows(dumps, "j")
    assert {r["rank"] for r in rows} == {0, 2, 3} and all(r["step"] == -1 for r in rows)


# ------------------------------------------------------------------------- simulated faults


STEP = (  # (group role, op, input sizes, dtype): one training step, as in the real scenarios
    ("world", "broadcast", [[4]], "Long"),
    ("tp", "all_gather", [[64]], "Float"),
    ("world", "all_reduce", [[520]], "Float"),
    ("dp", "all_reduce", [[6272]], "Float"),
    ("dp", "all_gather", [[3136]], "Float"),
    ("world", "all_reduce", [[1]], "Float"),
)


def _simulate(world: int = 4, steps: int = 5, edit=None, no_dump: tuple[int, ...] = ()) -> list[FRDump]:
    """Run a job's collectives to a standstill: a blocking collective completes once all members
    issued it. ``edit(rank, program)`` changes one rank's program (skip, stop, resize...)."""
    groups = {"world": lambda r: ("0", "default_pg")}
    groups["tp"] = lambda r: (str(1 + r // 2), f"tp_{r // 2}")
    groups["dp"] = lambda r: (str(1 + world // 2 + r % 2), f"dp_{r % 2}")
    members = defaultdict(set)
    programs = {}
    for r in range(world):
        programs[r] = [(groups[role](r), op, sizes, dt) for _ in range(steps) for role, op, sizes, dt in STEP]
        for role in groups:
            members[groups[role](r)[0]].add(r)
        if edit:
            edit(r, programs[r])
    entries: dict[int, list[dict]] = {r: [] for r in range(world)}
    pos, seqs, arrived, blocked = dict.fromkeys(range(world), 0), defaultdict(int), defaultdict(set), {}
    clock = 1_796_000_000_000_000_000
    progress = True
    while progress:
        progress = False
        for r in range(world):
            if r in blocked or pos[r] >= len(programs[r]):
                continue
            (name, desc), op, sizes, dt = programs[r][pos[r]]
            pos[r] += 1
            seqs[(r, name)] += 1
            key = (name, seqs[(r, name)])
            clock += 1000
            e = {
                "record_id": len(entries[r]),
                "process_group": (name, desc),
                "collective_seq_id": key[1],
                "p2p_seq_id": 0,
                "profiling_name": f"gloo:{op}",
                "input_sizes": sizes,
                "output_sizes": sizes,
                "input_dtypes": [dt],
                "output_dtypes": [dt],
                "retired": False,
                "time_created_ns": clock,
            }
            entries[r].append(e)
            arrived[key].add(r)
            blocked[r] = e
            progress = True
            if arrived[key] == members[name]:
                for q in members[name]:
                    blocked.pop(q)["retired"] = True
    return [
        parse_dump({"version": "2.10", "entries": entries[r]}, source_path=f"sim/rank{r}", fmt="sim")
        for r in range(world)
        if r not in no_dump
    ]


def _at(step: int, index: int) -> int:
    return (step - 1) * len(STEP) + index


def test_simulated_healthy_job_has_no_findings():
    assert analyze_flight_recorder(_simulate(world=8)) == []


def test_simulated_hang_in_compute():
    def stop(r, prog):
        if r == 2:
            del prog[_at(3, 2) :]  # stuck before the gradient all_reduce of step 3

    [f] = analyze_flight_recorder(_simulate(edit=stop))
    assert (f.kind, [s.rank for s in f.suspects]) == ("hang", [2])
    assert (f.evidence["pg"]["desc"], f.evidence["seq"], f.evidence["op"]) == ("default_pg", 8, "all_reduce")
    assert f.title == "rank 2 never entered all_reduce #8 of default_pg; ranks 0, 1, 3 are waiting in it"
    assert f.evidence["action"] == "restart_rank" and f.evidence["culprits"][0]["in_flight"] == []


def test_simulated_skip_in_a_small_group_blames_the_skipper_not_the_big_groups_missing_rank():
    # Rank 3 skips its tp all_gather: rank 2 waits in tp_1 for it, rank 3 goes on to the world
    # all_reduce where ranks 0, 1, 3 wait for rank 2. Counting waiters would blame rank 2.
    def skip(r, prog):
        if r == 3:
            del prog[_at(4, 1)]

    [f] = analyze_flight_recorder(_simulate(edit=skip))
    assert (f.kind, [s.rank for s in f.suspects]) == ("desync", [3])
    assert (f.evidence["pg"]["desc"], f.evidence["seq"]) == ("tp_1", 4)
    assert [(c["pg"]["desc"], c["missing"]) for c in f.evidence["consequences"]] == [("default_pg", [2])]


@pytest.mark.parametrize("culprit", [0, 5])
def test_simulated_size_and_op_mismatch(culprit):
    def resize(r, prog):
        if r == culprit:
            i = _at(2, 2)
            prog[i] = (prog[i][0], prog[i][1], [[1]], "Float")

    [f] = analyze_flight_recorder(_simulate(world=8, edit=resize))
    assert (f.kind, [s.rank for s in f.suspects], f.evidence["seq"]) == ("size_mismatch", [culprit], 5)
    assert f.evidence["input_sizes"] == [[520]] and "[[1]]" in f.title

    def swap(r, prog):
        if r == culprit:
            i = _at(2, 2)
            prog[i] = (prog[i][0], "broadcast", prog[i][2], "Float")

    [f] = analyze_flight_recorder(_simulate(world=8, edit=swap))
    assert (f.kind, [s.rank for s in f.suspects]) == ("desync", [culprit])
    assert f"rank {culprit} called broadcast" in f.title and f.evidence["action"] == "restart_job"


def test_simulated_crash_of_the_last_rank_needs_the_world_size():
    def stop(r, prog):
        if r == 3:
            del prog[_at(2, 2) :]

    dumps = _simulate(edit=stop, no_dump=(3,))
    # Without the world size nothing shows a rank 3 ever existed: gloo's groups are inferred from
    # entries, and every dumped member of every group has entered its pending collective.
    assert analyze_flight_recorder(dumps) == []
    [f] = analyze_flight_recorder(dumps, world_size=4)
    assert (f.kind, [s.rank for s in f.suspects], f.evidence["seq"]) == ("crash", [3], 5)


def test_simulated_culprit_missing_from_two_groups_gives_one_finding_at_the_first():
    def stop(r, prog):
        if r == 2:
            del prog[_at(3, 1) :]  # stuck before its tp all_gather of step 3

    [f] = analyze_flight_recorder(_simulate(edit=stop))
    assert f.title == "rank 2 never entered all_gather #3 of tp_1; rank 3 is waiting in it"
    # Ranks 0, 1 went on and wait for ranks 2 and 3 in the world all_reduce: a consequence.
    [c] = f.evidence["consequences"]
    assert (c["pg"]["desc"], c["seq"], c["entered"], c["missing"]) == ("default_pg", 8, [0, 1], [2, 3])


def test_nccl_style_dumps_use_pg_config_and_completion_times(tmp_path):
    truth = _truth("crashed_rank")
    config = {
        name: {"name": name, "desc": g["desc"], "ranks": str(g["ranks"])} for name, g in truth["process_groups"].items()
    }
    for src in sorted((DATA / "crashed_rank" / "fr_json").iterdir()):
        obj = json.loads(src.read_text())
        obj["pg_config"] = config
        for e in obj["entries"]:
            e["profiling_name"] = e["profiling_name"].replace("gloo:", "nccl:")
            if e["retired"]:
                e["state"] = "completed"
                e["time_discovered_completed_ns"] = e["time_created_ns"] + 5_000
        (tmp_path / src.name.replace("fr_trace_rank_", "nccl_trace_rank_")).write_text(json.dumps(obj))
    dumps = load_dumps(tmp_path)
    assert dumps[0].backend == "nccl" and dumps[0].pg_config[1].ranks == (0, 1)
    # Rank 1 (no dump) is now known to be in tp_0 and dp_1 too: still one finding, at seq 29.
    [f] = analyze_flight_recorder(dumps)
    assert (f.kind, [s.rank for s in f.suspects], f.evidence["seq"]) == ("crash", [1], 29)
    assert {c["pg"]["desc"] for c in f.evidence["consequences"]} == {"tp_0", "dp_1"}
    assert all("rank 1 is missing here too" in c["why"] for c in f.evidence["consequences"])
    rows = to_collective_rows(dumps, "j")
    assert {r["end_ns"] - r["enter_ns"] for r in rows if r["end_ns"] > 0} == {5_000}
    assert sum(r["end_ns"] == 0 for r in rows) == 1  # rank 3's seq 29


# ------------------------------------------------ post-mortems: world, victims, damaged dumps


def _copy(src: Path, dst: Path, ranks=None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if ranks is None or int(f.name.split("_")[-1].split(".")[0]) in ranks:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _cli(*args):
    from click.testing import CliRunner

    from ranklens.cli import cli

    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_world_size_and_members_from_group_sizes_when_the_last_rank_left_no_dump(tmp_path):
    # The healthy job without rank 3's dump: gloo's pg_config is empty, but every tp/dp group's
    # all_gather output is twice its input, so tp_1 = [2, ?] and dp_1 = [1, ?] miss one rank each.
    from ranklens.formats.flight_recorder import infer_process_groups, infer_world_size

    dumps = load_dumps(_copy(DATA / "healthy" / "fr_json", tmp_path / "fr", ranks={0, 1, 2}))
    world, source = infer_world_size(dumps)
    assert (world, source) == (4, "group sizes in the dumps (all-gather output / input)")
    groups, _ = infer_process_groups(dumps)
    truth = _truth("healthy")["process_groups"]
    assert {g.desc: list(g.members) for g in groups.values()} == {g["desc"]: g["ranks"] for g in truth.values()}
    [f] = analyze_flight_recorder(dumps)
    assert [s.rank for s in f.suspects] == [3] and f.evidence["missing_dumps"] == [3]
    assert f.evidence["world_size"] == 4 and f.evidence["world_size_source"] == source
    text = _cli("analyze", "--flight-recorder", str(tmp_path / "fr")).output
    assert "world size 4 (group sizes in the dumps" in text and "no dump from ranks: 3" in text


def test_world_size_from_the_default_groups_process_group_table(tmp_path):
    # gloo lists the default group's ranks under pg_config[''] while the job has no subgroup
    src = DATA / "size_mismatch_abort" / "fr_json"
    dumps = load_dumps(_copy(src, tmp_path / "fr", ranks={0, 2}))  # ranks 1 and 3 left no dump
    assert dumps[0].pg_config[0].pg_name == "" and dumps[0].pg_config[0].ranks == (0, 1, 2, 3)
    from ranklens.formats.flight_recorder import infer_process_groups, infer_world_size

    assert infer_world_size(dumps) == (4, "process-group table (pg_config) of the default group")
    groups, _ = infer_process_groups(dumps)
    assert list(groups) == ["0"]  # the '' key is the default group's table, not a group of its own
    assert [(p.pg.name, p.seq) for p in group_progress(dumps)] == [("0", 4)]


def test_rank_aborted_by_a_peers_size_mismatch_is_a_victim_not_the_cause():
    truth = _truth("size_mismatch_abort")
    dumps = load_dumps(DATA / "size_mismatch_abort" / "fr_json")
    assert [d.rank for d in dumps] == truth["dumped_ranks"]
    [f] = analyze_flight_recorder(dumps)
    assert (f.kind, [s.rank for s in f.suspects]) == ("size_mismatch", truth["culprit_ranks"])
    assert (f.evidence["pg"]["desc"], f.evidence["seq"]) == (truth["pg"], truth["collective_seq_id"])
    assert [v["rank"] for v in f.evidence["victims"]] == truth["victim_ranks"]
    assert f.evidence["missing_dumps"] == truth["missing_dump_ranks"]
    assert "rank 1 left no dump" in f.title and "victim, not the cause" in f.title
    assert f.evidence["related"][0]["kind"] == "crash"  # what it would have been blamed for


@pytest.mark.parametrize(("damaged", "culprit"), [(0, 2), (2, 2)])
def test_one_truncated_dump_is_reported_and_the_others_analysed(tmp_path, damaged, culprit):
    from ranklens.collector.flight_recorder import read_dumps

    fr = _copy(DATA / "desync" / "fr_pickle", tmp_path / "fr")
    bad = fr / f"fr_trace_rank_{damaged}"
    bad.write_bytes(bad.read_bytes()[:1000])
    dumps, unreadable = read_dumps(fr)
    assert [d.rank for d in dumps] == sorted({0, 1, 2, 3} - {damaged})
    [u] = unreadable
    assert (u.path, u.rank) == (str(bad), damaged) and "truncated" in u.error
    [f] = analyze_flight_recorder(dumps, unreadable=unreadable)
    assert [s.rank for s in f.suspects] == [culprit] and (f.evidence["pg"]["desc"], f.evidence["seq"]) == (
        "default_pg",
        35,
    )
    assert f.evidence["unreadable_dumps"][0]["rank"] == damaged and f.evidence["missing_dumps"] == []
    if damaged == culprit:  # nothing else explains the standstill: named, with what cannot be known
        assert "unreadable" in f.title and f.confidence <= 0.5 and "cannot be read" in f.evidence["cannot_know"]
    else:  # the readable dumps explain it: the rank with the damaged dump is not blamed
        assert f.kind == "desync" and f.confidence >= 0.9
    r = _cli("analyze", "--flight-recorder", str(fr), "--json")
    assert r.exit_code == 6
    out = json.loads(r.stdout)
    assert [s["rank"] for s in out["findings"][0]["suspects"]] == [culprit]
    assert out["unreadable_dumps"][0]["path"] == str(bad)
    assert "could not be read (the others were analysed" in r.stderr and str(bad) in r.stderr
    text = _cli("analyze", "--flight-recorder", str(fr)).stdout
    assert f"unreadable dump of rank {damaged}: {bad}" in text and f"dump unreadable {damaged}" in text
    assert "no dump from ranks: -" in text  # it is not taken for a rank that left no dump


def test_deeply_nested_json_dump_is_bad_input_exit_6_and_the_others_are_analysed(tmp_path):
    fr = _copy(DATA / "desync" / "fr_json", tmp_path / "fr")
    deep = fr / "fr_trace_rank_1.json"
    deep.write_text('{"version": "2.10", "entries": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(IngestError, match="nested too deeply") as e:
        load_dump(deep)
    assert e.value.path == str(deep)
    r = _cli("analyze", "--flight-recorder", str(fr), "--json")
    assert r.exit_code == 6, r.output
    assert "nested too deeply" in r.stderr and "Traceback" not in r.output
    out = json.loads(r.stdout)
    assert out["dumps"] == [0, 2, 3]
    assert [(f["kind"], [s["rank"] for s in f["suspects"]]) for f in out["findings"]] == [("desync", [2])]
    # a nested value inside a field is described without recursing
    obj = json.loads((DATA / "desync" / "fr_json" / "fr_trace_rank_1.json").read_text())
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    obj["entries"][0]["input_sizes"] = nested
    with pytest.raises(IngestError, match="input_sizes"):
        parse_dump(obj, source_path="x/fr_trace_rank_1.json")


def test_job_and_attempt_from_the_spool_path(tmp_path, embedded_store):
    from ranklens.collector.flight_recorder import job_from_path

    fr = _copy(DATA / "desync" / "fr_json", tmp_path / "spool" / "train-42" / "3" / "fr")
    assert job_from_path(sorted(str(p) for p in fr.iterdir())) == ("train-42", 3)
    assert job_from_path([str(DATA / "desync" / "fr_json" / "fr_trace_rank_0.json")]) is None
    out = json.loads(_cli("analyze", "--flight-recorder", str(tmp_path / "spool" / "train-42"), "--json").stdout)
    assert (out["job_id"], out["attempt"]) == ("train-42", 3)
    assert {f["job_id"] for f in out["findings"]} == {"train-42"}
    assert ingest_flight_recorder(embedded_store, fr)["collectives"] > 0
    assert embedded_store.query("SELECT DISTINCT job_id FROM collectives").rows() == [("train-42",)]


@pytest.mark.e2e
def test_real_traced_job_size_mismatch_post_mortem_from_the_spool(tmp_path, embedded_store):
    """A real traced gloo job: rank 2 passes 1000 floats where the others pass 520 at step 4. The
    dumps the tracer wrote into the spool name the job, the shipped ledger gives the step, and the
    rank gloo aborted for it (no dump) is a victim, not the cause."""
    import os
    import socket
    import subprocess
    import sys

    from ranklens.collector import Shipper

    spool, job_id = tmp_path / "spool", "fr-mismatch"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "4",
           "RANKLENS_SPOOL": str(spool), "RANKLENS_JOB_ID": job_id, "OMP_NUM_THREADS": "1",
           "FR_RANK": "2", "FR_STEP": "4"}  # fmt: skip
    script = Path(__file__).parent.parent.joinpath("fr_mismatch_job.py")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for r in range(4)
    ]
    logs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    codes = [p.returncode for p in procs]
    aborted = [r for r, c in enumerate(codes) if c == -6]  # SIGABRT: gloo's size check
    assert aborted and 2 not in aborted, (codes, logs)
    assert any("Received data size doesn't match expected size" in logs[r] for r in aborted)
    Shipper(spool, embedded_store).ship_once()
    fr = spool / job_id / "0" / "fr"
    assert sorted(int(p.name.split("_")[-1].split(".")[0]) for p in fr.glob("fr_trace_rank_*.json")) == sorted(
        set(range(4)) - set(aborted)
    )
    r = _cli("analyze", "--flight-recorder", str(fr), "--store", embedded_store.url, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["job_id"], out["attempt"], out["world_size"], out["missing_dumps"]) == (job_id, 0, 4, aborted)
    [f] = out["findings"]
    assert (f["kind"], [s["rank"] for s in f["suspects"]]) == ("size_mismatch", [2])
    assert [v["rank"] for v in f["evidence"]["victims"]] == aborted
    assert f["first_seen_step"] == f["evidence"]["step"] == 4 and f["job_id"] == job_id
    # saved into the job's findings, where `ranklens analyze --job` shows it
    assert embedded_store.query(f"SELECT count() FROM findings WHERE job_id = '{job_id}'").scalar() == 1
