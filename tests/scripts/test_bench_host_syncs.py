"""scripts.bench.host_syncs counts the host reads of the tiny pair's steps on the CPU; counts, no timing."""

from __future__ import annotations

import pytest
import torch

from scripts.bench import host_syncs

pytestmark = pytest.mark.models  # loads and runs the tiny pair: not in the fast tier


def test_the_counter_sees_reads_of_device_tensors_only():
    weight = torch.nn.Linear(2, 2)
    with host_syncs.HostReads("cpu", [weight]) as counter:
        host = torch.ones(2)
        host.tolist(), bool(host.any())  # a host tensor: no read
        out = weight(host)
        assert counter.reads == 0
        out.tolist()
        bool(out.sum() > 0)
        out.cpu().tolist()  # the copy is the read; the list of the copy is not
        moved = torch.zeros(2).to(torch.device("cpu"))  # moved to the device
        moved.to("cpu")
    assert counter.by_method == {"tolist": 1, "__bool__": 1, "cpu": 1, "to": 1}, counter.by_line
    assert counter.reads == 4


def test_the_table_gives_a_count_for_every_row(tiny_models_dir, capsys):
    assert host_syncs.main(["--models", str(tiny_models_dir), "--batch-sizes", "1,2", "--steps", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(index for index, line in enumerate(lines) if line.startswith("| pair |"))
    assert "host reads a step" in lines[header]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[header + 2 :] if line]
    keys = [(row[1], row[2], row[3]) for row in rows]
    assert keys == [(b, k, mode) for b in ("1", "2") for k in ("0", "4") for mode in host_syncs.MODES]
    for row in rows:
        reads = float(row[4])
        assert reads == int(reads) >= 1  # every step reads its outcome once at least
    drafting = [int(float(row[4])) for row in rows if row[2] == "4"]
    assert len(drafting) == 2 * len(host_syncs.MODES) and all(isinstance(num, int) for num in drafting)


@pytest.mark.parametrize("runner", ["dynamic", "static"])
def test_a_drafting_step_of_fixed_k_reads_the_device_once(tiny_models_dir, runner):
    """The draft loop's chains stay on the device into the verify pass and are read with the verdict:
    one read a step, drafting or not, greedy, sampled, seeded and penalised, as plain decoding's."""
    argv = ["--models", str(tiny_models_dir), "--batch-sizes", "1,3", "--steps", "3", "--runner", runner]
    counts, _ = host_syncs.report_lines(host_syncs.parse_args(argv))
    assert {(count.k, count.mode) for count in counts} == {(k, mode) for k in (0, 4) for mode in host_syncs.MODES}
    for count in counts:
        assert count.reads == count.steps, (count.batch, count.k, count.mode, count.by_line)


def test_the_confidence_stop_by_mask_reads_the_drafts_once_a_proposal(tiny_models_dir):
    """Planned steps whose chains the draft's confidence stops: the drafter reads at most once a step by
    mask, four times a pass (drafts, confidences, runners-up and their probabilities) by the loop."""
    argv = ["--models", str(tiny_models_dir), "--batch-sizes", "2", "--steps", "2", "--warmup", "1"]
    for stop in ("mask", "loop"):
        counts, lines = host_syncs.report_lines(host_syncs.parse_args([*argv, "--confidence-stop", stop]))
        assert f"the confidence stop by {stop}" in lines[0]
        for count in counts:
            drafter = sum(num for line, num in count.by_line.items() if line.startswith("handler/drafters/"))
            if count.k == 0:
                assert drafter == 0
            elif stop == "mask":
                assert 0 < drafter <= count.steps, count.by_line
            else:
                assert drafter > count.steps, count.by_line
