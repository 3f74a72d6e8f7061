"""ranklens.formats.blacklist: the file pre-flight and the Slurm executor both write."""

from __future__ import annotations

import json

from ranklens.formats.blacklist import read_blacklist, write_blacklist


def test_plain_and_json_round_trip_and_keep_other_keys(tmp_path):
    plain = str(tmp_path / "bad.txt")
    assert read_blacklist(plain) == ([], {}, {})  # missing: empty
    write_blacklist(plain, ["n1", "n2"], {"n1": "ignored in a plain file"})
    assert (tmp_path / "bad.txt").read_text() == "n1\nn2\n"
    (tmp_path / "bad.txt").write_text("# drained by hand\nn1\n\nn2\n")
    assert read_blacklist(plain) == (["n1", "n2"], {}, {})
    js = str(tmp_path / "bad.json")
    write_blacklist(js, ["n3"], {"n3": ["gpu.ecc: 4 uncorrectable"]}, {"run_id": "pf-1"})
    assert json.loads((tmp_path / "bad.json").read_text()) == {
        "run_id": "pf-1", "nodes": ["n3"], "reasons": {"n3": ["gpu.ecc: 4 uncorrectable"]},
    }  # fmt: skip
    assert read_blacklist(js) == (["n3"], {"n3": ["gpu.ecc: 4 uncorrectable"]}, {"run_id": "pf-1"})
    assert not list(tmp_path.glob("*.tmp*"))  # replaced atomically, nothing left behind
