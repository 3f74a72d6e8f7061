"""The drill's grammar, suite files and scoring rules, without a job."""

from __future__ import annotations

import math

import pytest

from ranklens.drill.faults import DrillKind, parse_drill_fault, validate_targets
from ranklens.drill.runner import world_size_of
from ranklens.drill.score import Onset, Seen, costless, score
from ranklens.drill.suites import QUICK, load_suite
from ranklens.errors import ConfigError
from tests._jobs import ranklens


@pytest.mark.parametrize(
    "spec",
    [
        "slow_gpu:2:1.5@8",
        "slow_gpu:2:40ms@8",
        "slow_gpu:1:1.3:optimizer@3",
        "slow_data:1:0.2@5",
        "hang:3@6",
        "hang:3:30@6",
        "crash:1:3@6",
        "crash:2:kill@6",
        "desync:2@6",
        "log:0:nccl_error@4",
        "log:0:cuda_oom@20s",
        "gpu:3:79@6",
        "nan:1@6",
    ],
)
def test_specs_parse_back_to_themselves(spec):
    f = parse_drill_fault(spec)
    assert f.spec == spec
    assert parse_drill_fault(f.spec) == f


def test_defaults_and_units():
    assert parse_drill_fault("slow_data:1:200ms").severity == pytest.approx(0.2)
    assert math.isinf(parse_drill_fault("hang:0").severity)
    assert parse_drill_fault("crash:0").severity == 1.0
    assert parse_drill_fault("gpu:0").severity == 79.0
    assert parse_drill_fault("log:0").detail == "nccl_error"
    f = parse_drill_fault("log:1:xid@12s")
    assert (f.onset_s, f.onset_step) == (12.0, -1)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (
            "melt:1",
            "unknown kind 'melt' (kinds: slow_gpu, slow_data, hang, crash, desync, size_mismatch, log, gpu, nan, "
            "slow_link)",
        ),
        ("hang", "hang needs a target: a rank"),
        ("hang:x", "target 'x' is neither a rank"),
        ("slow_gpu:1:0.9", "factor 0.9 must be > 1"),
        ("slow_gpu:1:1.5:sideways", "phase 'sideways' is not one of forward, backward, optimizer"),
        ("crash:1:300", "exit code '300' is not 1..255 or 'kill'"),
        ("log:1:gremlins", "log class 'gremlins' is not one of nccl_error, nccl_timeout, cuda_oom, xid"),
        ("hang:1@soon", "onset 'soon' after '@' is neither a step"),
        ("desync:1:2", "too many fields"),
        ("nan:1:2", "too many fields"),
    ],
)
def test_bad_specs_say_what_is_wrong_and_what_is_allowed(spec, says):
    with pytest.raises(ConfigError) as e:
        parse_drill_fault(spec)
    assert says in str(e.value)
    assert "e.g." in str(e.value)


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(ConfigError, match=r"rank 4 is not a rank of this 4-rank job \(0\.\.3\)"):
        validate_targets([parse_drill_fault("hang:4@2")], 4)


def test_world_size_from_torchrun_arguments():
    assert world_size_of(["torchrun", "--nproc-per-node", "4", "t.py"]) == 4
    assert world_size_of(["torchrun", "--nnodes=2", "--nproc_per_node=8", "t.py"]) == 16
    assert world_size_of(["torchrun", "--nproc-per-node", "gpu", "t.py"]) is None
    assert world_size_of(["python", "t.py"]) is None


def _seen(id_, kind, ranks, t, **ev):
    return Seen(id_, kind, tuple(ranks), f"{kind} on {ranks}", int(t * 1e9), int(t * 1e9), ev)


def test_scoring_detection_culprit_kind_and_false_alarms():
    faults = [parse_drill_fault("slow_gpu:2:1.5@8"), parse_drill_fault("log:0:cuda_oom@4")]
    onsets = {0: Onset(int(100e9), 8), 1: Onset(int(90e9), 4)}
    seen = [
        _seen("a", "straggler", [1], 95),  # before the straggler's onset, wrong rank: false
        _seen("b", "straggler", [2], 104),  # detects fault 0
        _seen("c", "log_error", [0], 91, **{"class": "nccl_error"}),  # rank right, class wrong
        _seen("d", "straggler", [3], 120),  # a second straggler nothing explains: false
    ]
    scores, false = score(faults, onsets, seen)
    assert scores[0].detected and scores[0].ok and scores[0].ttd_s == pytest.approx(4.0)
    assert scores[1].detected and scores[1].culprit_ok and not scores[1].kind_ok
    assert scores[1].note == "detected as log_error (nccl_error), not log_error (cuda_oom)"
    assert [s.id for s in false] == ["a", "d"]
    # the onset error is reported where the finding names a step (the log line names none)
    assert scores[0].onset_error_steps is None and scores[0].to_json()["onset_error_steps"] is None
    seen[1] = Seen("b", "straggler", (2,), "rank 2 since step 9", int(104e9), int(101e9), first_step=9)
    scores, _ = score(faults, onsets, seen)
    assert scores[0].onset_error_steps == 1 and scores[0].to_json()["onset_error_steps"] == 1


def test_after_a_fatal_fault_the_peers_errors_are_collateral():
    faults = [parse_drill_fault("crash:1:3@6")]
    onsets = {0: Onset(int(50e9), 6)}
    seen = [
        _seen("x", "log_error", [3], 51, **{"class": "network"}),  # a peer losing its connection
        _seen("y", "crash", [1], 52),
        _seen("z", "straggler", [0], 40),  # before the crash: not collateral
    ]
    scores, false = score(faults, onsets, seen)
    assert scores[0].ok and scores[0].finding and scores[0].finding.id == "y"
    assert [s.id for s in false] == ["z"]


def test_a_fault_that_never_started_is_not_detected():
    scores, false = score([parse_drill_fault("hang:1@500")], {}, [_seen("h", "hang", [1], 10)])
    assert not scores[0].applied and not scores[0].detected and "never took effect" in scores[0].note
    assert [s.id for s in false] == ["h"]


def test_the_quick_suite_covers_every_kind_on_four_ranks():
    kinds = {f.kind for d in QUICK.drills for f in d.faults}
    assert kinds == set(DrillKind) - {DrillKind.SLOW_LINK}  # the link needs root: --suite network
    for d in QUICK.drills:
        validate_targets(list(d.faults), 4, 1)
    (d,) = load_suite("network").drills
    assert [f.kind for f in d.faults] == [DrillKind.SLOW_LINK]


def test_suite_files(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('command = ["python", "t.py"]\n[[drill]]\nname = "h"\nfaults = ["hang:1@3"]\n')
    s = load_suite(str(p))
    assert s.drills[0].command == ("python", "t.py") and s.drills[0].faults[0].kind is DrillKind.HANG
    for text, says in [
        ("[[drill]\n", "not valid TOML"),
        ('command = ["x"]\n', "no [[drill]] tables"),
        ('command = ["x"]\n[[drill]]\nfaults = []\n', "faults must be a non-empty list"),
        ('command = ["x"]\n[[drill]]\nfaults = ["melt:1"]\n', "unknown kind 'melt'"),
        ('[[drill]]\nfaults = ["hang:1"]\n', "no command"),
        ('colour = 1\ncommand = ["x"]\n[[drill]]\nfaults = ["hang:1"]\n', "unknown key(s) colour"),
    ]:
        p.write_text(text)
        with pytest.raises(ConfigError, match=r"--suite .*s\.toml") as e:
            load_suite(str(p))
        assert says in str(e.value)
    with pytest.raises(ConfigError, match="no built-in suite of that name"):
        load_suite(str(tmp_path / "missing.toml"))


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--fault", "melt:1"], "unknown kind 'melt'"),
        (["--fault", "hang:7@3"], "rank 7 is not a rank of this 4-rank job (0..3)"),
        (
            ["--fault", "hang:5@3", "--", "torchrun", "--nproc-per-node", "2", "t.py"],
            "rank 5 is not a rank of this 2-rank job",
        ),
        (["--suite", "nosuch"], "no built-in suite of that name (quick, recovery, network)"),
        (["--fault", "hang:node1@3"], "node 1 is not a node of this 1-node job (node0)"),
        (["--fault", "slow_link:node3:40mbit@8"], "node 3 is not a node of this 3-node job (node0..node2)"),
        (
            ["--fault", "slow_link:node1@8", "--", "python", "t.py"],
            "the command must be torchrun or python -m torch.distributed.run, not 'python'",
        ),
        (["--fault", "desync:node1@3"], "desync is one rank's doing"),
        (["--suite", "recovery"], "--suite recovery measures fault -> training resumed: give --recover POLICY"),
        ([], "give --fault SPEC"),
        (["--fault", "hang:1@3", "--interval", "-1"], "--interval -1: must be a number of seconds > 0"),
        (["--fault", "hang:1@3", "--timeout", "0"], "--timeout 0: must be a number of seconds > 0"),
    ],
)
def test_cli_bad_input_exits_2_before_any_job(tmp_path, args, says):
    r = ranklens("drill", "--store", f"embedded://{tmp_path / 'st'}", *args, timeout=120)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr


def test_a_nan_fault_explains_the_jobs_own_nan_loss_lines():
    faults = [parse_drill_fault("nan:2@10")]
    onsets = {0: Onset(int(10e9), 10)}
    seen = [
        _seen("n", "nan", [2], 12),
        _seen("l", "log_error", [-1], 13, **{"class": "nan_loss"}),  # rank 0 prints "loss nan"
        _seen("o", "log_error", [-1], 13, **{"class": "cuda_oom"}),  # not the NaN's doing
    ]
    scores, false = score(faults, onsets, seen)
    assert scores[0].ok
    assert [s.id for s in false] == ["o"]


def test_a_finding_that_names_another_rank_is_a_detection_with_the_wrong_culprit():
    faults = [parse_drill_fault("slow_gpu:2:1.5@8"), parse_drill_fault("log:0:nccl_error@4")]
    onsets = {0: Onset(int(100e9), 8), 1: Onset(int(90e9), 4)}
    seen = [
        _seen("w", "straggler", [3], 104),  # the slowdown blamed on rank 3
        _seen("l", "log_error", [0], 91, **{"class": "nccl_error"}),
    ]
    scores, false = score(faults, onsets, seen)
    assert scores[0].detected and not scores[0].culprit_ok and not scores[0].ok
    assert scores[0].note == "detected, but it names rank(s) 3, not 2"
    assert scores[1].ok and false == []


def test_a_finding_on_the_faults_rank_before_its_onset_is_false():
    scores, false = score(
        [parse_drill_fault("slow_gpu:2:1.5@8")], {0: Onset(int(100e9), 8)}, [_seen("e", "straggler", [2], 20)]
    )
    assert not scores[0].detected and [s.id for s in false] == ["e"]


def test_a_finding_that_began_before_a_crash_is_not_collateral():
    faults = [parse_drill_fault("crash:1:3@6")]
    early = Seen("s", "straggler", (0,), "rank 0 slow", int(52e9), int(30e9), {})  # began at 30 s, shown at 52 s
    scores, false = score(faults, {0: Onset(int(50e9), 6)}, [early, _seen("c", "crash", [1], 51)])
    assert scores[0].ok and [s.id for s in false] == ["s"]


def test_warnings_that_cost_the_job_nothing_are_costless_not_false_alarms():
    cheap = Seen("c", "straggler", (3,), "rank 3 +8%, 0% of step time", 10, 10, {}, "warning", 0.0)
    real = Seen("r", "straggler", (1,), "rank 1 +40%", 10, 10, {}, "warning", 25.0)
    crit = Seen("k", "straggler", (2,), "rank 2", 10, 10, {}, "critical", 0.5)
    log = Seen("l", "log_error", (0,), "oom", 10, 10, {}, "error")
    alarms, quiet = costless([cheap, real, crit, log])
    assert [s.id for s in alarms] == ["r", "k", "l"] and [s.id for s in quiet] == ["c"]


# --- node targets and the throttled link ------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "node", "canonical"),
    [
        ("hang:node1@6", 1, "hang:node1@6"),
        ("crash:node0001:3@6", 1, "crash:node1:3@6"),
        ("slow_gpu:node2:1.5@8", 2, "slow_gpu:node2:1.5@8"),
        ("log:node0:xid@4", 0, "log:node0:xid@4"),
        ("slow_link:node2:40mbit@8", 2, "slow_link:node2:40mbit@8"),
        ("slow_link:2", 2, "slow_link:node2:40mbit"),  # a link is a node's: 2 is node 2, as in simulate
        ("slow_link:node0003:5mbps@10s", 3, "slow_link:node3:5mbps@10s"),
    ],
)
def test_node_targets_parse(spec, node, canonical):
    f = parse_drill_fault(spec)
    assert (f.node, f.rank, f.spec) == (node, -1, canonical)
    assert parse_drill_fault(f.spec) == f


def test_a_rate_is_bits_per_second_as_tc_reads_it():
    assert parse_drill_fault("slow_link:node1:40mbit").severity == 40e6
    assert parse_drill_fault("slow_link:node1:5mbps").severity == 40e6  # tc's bps: bytes per second


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("desync:node1@3", "desync is one rank's doing: its target must be a rank, not 'node1'"),
        ("nan:node0@3", "nan is one rank's doing"),
        ("size_mismatch:node1", "size_mismatch is one rank's doing"),
        ("hang:nodeX@3", "target 'nodeX' is neither a rank (an integer >= 0) nor a node (node1, node0001)"),
        ("slow_link:node2:3", "rate '3' is not a tc rate"),
        ("slow_link", "slow_link needs a target: a node (node2)"),
    ],
)
def test_bad_node_targets_say_what_is_allowed(spec, says):
    with pytest.raises(ConfigError) as e:
        parse_drill_fault(spec)
    assert says in str(e.value) and "e.g." in str(e.value)


def test_a_node_outside_the_job_is_refused():
    with pytest.raises(ConfigError, match=r"node 3 is not a node of this 3-node job \(node0\.\.node2\)"):
        validate_targets([parse_drill_fault("slow_link:node3@5")], 3, 3)
    with pytest.raises(ConfigError, match=r"node 1 is not a node of this 1-node job \(node0\)"):
        validate_targets([parse_drill_fault("hang:node1@5")], 4, 1)
    with pytest.raises(ConfigError, match="a slow link needs a job of 2 nodes or more"):
        validate_targets([parse_drill_fault("slow_link:node0@5")], 4, 1)
    validate_targets([parse_drill_fault("hang:node0@5")], 4, 1)  # node 0 of the one-node job: every rank


def test_the_bed_job_shape_and_agent_commands():
    from ranklens.analyzers.netbed import NetBed
    from ranklens.drill.network import agent_commands
    from ranklens.drill.runner import job_shape, nodes_of
    from ranklens.drill.suites import network_command, quick_command

    link = [parse_drill_fault("slow_link:node2@8")]
    assert job_shape(network_command(30), link) == (3, 3)
    assert job_shape(quick_command(), [parse_drill_fault("hang:1@3")]) == (4, 1)
    # a user's single-node torchrun command goes onto a bed of the default 3 nodes
    assert job_shape(["torchrun", "--standalone", "--nproc-per-node", "2", "t.py"], link) == (6, 3)
    assert nodes_of(["python", "t.py"]) is None
    cmds = agent_commands(
        ["torchrun", "--standalone", "--nnodes", "2", "--nproc-per-node=2", "--master-port", "1", "t.py", "--x", "1"],
        NetBed(2, prefix="rlx"),
    )
    assert cmds[1][:4] == ["ip", "netns", "exec", "rlx-n1"] and "node1" in cmds[1]
    tail = cmds[1][cmds[1].index("torchrun") :]
    assert tail == [
        "torchrun", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.77.0.1", "--master-port", "29500",
        "--nproc-per-node=2", "t.py", "--x", "1",
    ]  # fmt: skip
    with pytest.raises(ConfigError, match=r"the command must be torchrun or python -m torch\.distributed\.run"):
        job_shape(["python", "t.py"], link)


def _node_seen(id_, kind, ranks, nodes, t):
    return Seen(id_, kind, tuple(ranks), f"{kind} on {nodes}", int(t * 1e9), int(t * 1e9), {}, nodes=tuple(nodes))


def test_scoring_a_slow_link_by_its_node():
    from ranklens.drill.score import Target

    faults = [parse_drill_fault("slow_link:node2:40mbit@8")]
    onsets = {0: Onset(int(100e9), 8)}
    nodes = {0: Target(frozenset({0}), frozenset({"node0"})), 2: Target(frozenset({2}), frozenset({"node2"}))}
    seen = [
        _node_seen("w", "straggler", [2], ["node2"], 103),  # the link seen by per-rank timers: explained
        _node_seen("l", "slow_link", [0, 2], ["node0", "node2"], 110),  # the node0<->node2 pair link touches node 2
        _node_seen("c", "network_congestion", [], [], 111),  # nothing explains it: false
    ]
    scores, false = score(faults, onsets, seen, nodes)
    assert scores[0].ok and scores[0].finding and scores[0].finding.id == "l" and scores[0].ttd_s == pytest.approx(10)
    assert [s.id for s in false] == ["c"]
    wrong = [_node_seen("x", "slow_link", [0], ["node0"], 104)]
    scores, false = score(faults, onsets, wrong, nodes)
    assert scores[0].detected and not scores[0].culprit_ok
    assert scores[0].note == "detected, but it names rank(s) 0 and node(s) node0, not node2"


def test_a_node_fault_is_named_by_any_rank_of_the_node():
    from ranklens.drill.score import Target

    scores, false = score(
        [parse_drill_fault("hang:node1@6")],
        {0: Onset(int(50e9), 6)},
        [_seen("h", "hang", [3], 55)],
        {1: Target(frozenset({2, 3}), frozenset({"node1"}))},
    )
    assert scores[0].ok and false == []
