"""scripts/batch_mix.py's rate under load: the tokens committed until fewer requests are left than
slots, over that time (the drain at a run's end left out)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "batch_mix.py"
spec = importlib.util.spec_from_file_location("batch_mix", SCRIPT)
batch_mix = importlib.util.module_from_spec(spec)
spec.loader.exec_module(batch_mix)


def test_the_rate_under_load_stops_where_the_drain_begins():
    # 4 requests, 2 slots: the third finish (at 6.0) leaves one request, so the window is 0..6
    commits = [(1.0, 3), (2.0, 3), (5.0, 4), (6.0, 2), (7.0, 5), (9.0, 5)]
    finishes = [9.0, 2.0, 6.0, 5.0]
    assert batch_mix.loaded_rate(commits, finishes, began=0.0, slots=2) == (3 + 3 + 4 + 2) / 6.0
    assert batch_mix.loaded_rate(commits, finishes, began=0.0, slots=3) == (3 + 3 + 4) / 5.0  # the second finish


def test_one_closed_batch_has_no_rate_under_load():
    assert batch_mix.loaded_rate([(1.0, 8)], [1.0, 2.0], began=0.0, slots=2) is None


def test_the_paired_ratio_takes_each_rounds_own_ratio():
    """A host twice as fast in the second round: each round's own ratio is 0.9, while the medians of
    the kinds' rates taken apart mix the rounds."""
    rounds = {"spec": [{"whole": 10.0}, {"whole": 20.0}, {"whole": 10.0}],
              "ar": [{"whole": 10.0}, {"whole": 20.0}, {"whole": 30.0}],
              "mixed": [{"whole": 9.0}, {"whole": 18.0}, {"whole": 18.0}]}
    assert batch_mix.paired_ratio(rounds, "whole") == 0.9
    medians = {name: sorted(r["whole"] for r in runs)[1] for name, runs in rounds.items()}
    assert batch_mix.split_ratio(medians) == 2 * 18.0 / (10.0 + 20.0)  # 1.2: not any round's ratio
