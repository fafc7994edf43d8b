"""scripts.bench.gpu_check runs end to end on the CPU with tiny shapes: every section, its JSON and its tables.

No timing is asserted: the GPU figures live in docs/benchmarks/.
"""

from __future__ import annotations

import json

import pytest

from scripts.bench import gpu_check

pytestmark = pytest.mark.models  # builds and runs models: not in the fast tier

SECTIONS = [
    "CUDA tests",
    "Pass times and c",
    "Verify cost by width and batch",
    "Engine: draft = target against target-only",
    "Engine profile",
    "Against HF assisted generation",
    "Predicted speedup E/(kc+1)",
]


def test_gpu_check_writes_every_section_on_the_cpu(tmp_path, capsys):
    argv = [str(tmp_path), "--device", "cpu", "--max-new-tokens", "8", "--repeats", "1"]
    assert gpu_check.main(argv) == 0
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(data) == ["header", *SECTIONS]  # no section FAILED
    # Without a GPU the CUDA tier is collected and skipped, not failed.
    assert data["CUDA tests"]["returncode"] == 0 and "skipped" in data["CUDA tests"]["summary"]
    engine = data["Engine: draft = target against target-only"]
    for kind in ("dynamic", "static"):
        row = engine[f"1.5B_{kind}"]
        assert row["draft_equals_target"]["acceptance"] == 1.0  # float32: the draft is the target
        assert row["target_only"]["tokens_per_step"] == pytest.approx(8 / 8, abs=0.2)
    assert set(data["Predicted speedup E/(kc+1)"]) == {"1.5B", "7B"}
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert all(f"## {section}" in markdown for section in SECTIONS)
    assert "| 0.5B -> 7B | static |" in markdown
    assert (tmp_path / "engine_profile.txt").read_text().strip()


def test_gpu_check_refuses_cuda_without_a_gpu(monkeypatch):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        gpu_check.main(["out", "--device", "cuda"])


def test_the_load_sections_serve_the_pair_and_keep_every_output_equal_to_plain(tmp_path):
    """The load sections save the pair, run scripts.bench.load on it and report; in float32 no row's
    outputs differ from plain decoding's."""
    argv = [str(tmp_path), "--device", "cpu", "--skip-tests", "--sections", "load,load-fp32", "--repeats", "1"]
    assert gpu_check.main(argv) == 0
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(data) == ["header", "Pass times and c", "Load (load, scripts.bench.load)",
                          "Load (load-fp32, scripts.bench.load)"]  # fmt: skip
    for name in ("load", "load-fp32"):
        report = json.loads((tmp_path / name / "load.json").read_text())
        assert report["settings"]["dtype"] == "float32"
        for load, rows in report["loads"].items():
            assert set(rows) == {"shipped", "plain", "k2"}, load
            assert all(cell["outputs_differ"] == 0 for cell in rows.values()), (name, load)
        assert (tmp_path / name / "load.png").stat().st_size > 0
    assert "--rates" in data["Load (load-fp32, scripts.bench.load)"]["argv"]


def test_the_cross_family_and_admission_sections_run_on_the_cpu(tmp_path):
    argv = [str(tmp_path), "--device", "cpu", "--skip-tests", "--sections", "cross,admission", "--repeats", "1",
            "--max-new-tokens", "8"]  # fmt: skip
    assert gpu_check.main(argv) == 0
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(data) == ["header", "Pass times and c", "A draft from another family (135M shape)",
                          "Admitting 4 requests (torch.float32)"]  # fmt: skip
    cross = data["A draft from another family (135M shape)"]
    for kind in ("dynamic", "static"):
        assert {"135M", "0.5B", "1.5B_verify"} == set(cross[kind])
        for name in ("0.5B, same vocabulary", "135M, other vocabulary, SLEM", "135M, other vocabulary, TLI"):
            assert cross[f"{kind} {name}"]["tokens_per_s"] > 0
    admission = data["Admitting 4 requests (torch.float32)"]
    assert set(admission) == {f"{kind} k{k}" for kind in ("dynamic", "static") for k in (0, 2)}
    assert (tmp_path / "admission_profile.txt").exists()


def test_the_replay_section_replays_the_recorded_acceptance_on_both_targets(tmp_path):
    """On the CPU the tiny shapes replay two requests of the shipped trace's grounded set at C = 1: every row of
    scripts.bench.replay for each target, the replayed rows at the trace's tokens a pass."""
    argv = [str(tmp_path), "--device", "cpu", "--skip-tests", "--sections", "replay", "--repeats", "1"]
    assert gpu_check.main(argv) == 0
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(data) == ["header", "Pass times and c", "Replayed acceptance (scripts.bench.replay)"]
    section = data["Replayed acceptance (scripts.bench.replay)"]
    assert set(section) == {"1.5B", "7B"}
    for report in section.values():
        cells = report["cells"]
        assert [cell["row"] for cell in cells] == ["plain", "fixed", "planned", "free"]
        for cell in cells:
            if cell["row"] in ("fixed", "free"):
                assert cell["tokens_per_pass"] == pytest.approx(cell["trace_tokens_per_pass"])
                assert cell["counts"]["passes"] == cell["counts"]["as_recorded"] > 0
    assert "| row (replayed acceptance) |" in (tmp_path / "gpu_check.md").read_text()


def test_the_own_time_section_measures_plain_and_penalised_rows(tmp_path):
    """On the CPU the tiny pair, static runner: the own-time table, then again with penalties, each with
    plain, priced-out and k = 4 rows at batch 1 and 16, the drafting rows taking every draft."""
    argv = [str(tmp_path), "--device", "cpu", "--skip-tests", "--sections", "own", "--repeats", "1"]
    assert gpu_check.main(argv) == 0
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    section = data["Own time a step (scripts.bench.own_time)"]
    assert list(section) == ["the tiny pair", "the tiny pair, penalised"]
    for rows in section.values():
        assert [(row["batch"], row["k"]) for row in rows] == [(b, k) for b in (1, 16) for k in ("0", "0, planned", "4")]
        assert all(row["tokens_per_row_step"] == 5.0 for row in rows if row["k"] == "4")
