"""DBloom's stranded-tau estimate counts only the positions an expansion could add.

Before: it summed the tail rate's geometric series to infinity with the rate capped at 0.999, so a
full tail at B = 12 reported up to 999 extra tokens per ceiling cycle (10.5 tokens per cycle on a
server's /metrics gauge), more than any expansion could add. Checked on histograms whose answer is
known exactly.
"""

from fractions import Fraction

import pytest

from trtspec.dbloom.histogram import Preflight
from trtspec.limits import MAX_BLOCK_SIZE


def test_a_full_ceiling_bin_strands_exactly_the_positions_an_expansion_adds():
    """Every cycle accepted all 11 drafts of B = 12 and every position accepts: expanding to 24 adds 12."""
    full = Preflight(12, [0] * 11 + [100], tau=12.0, max_block_size=24)
    assert full.tail_rate == 1.0 and full.ceiling_fraction == 1.0
    assert full.stranded_tokens_per_cycle == 12.0
    assert full.stranded_tau_estimate == 24.0  # the tau of B = 24 when it accepts everything
    assert Preflight(12, [0] * 11 + [100], tau=12.0).stranded_tokens_per_cycle == MAX_BLOCK_SIZE - 12


def test_an_empty_ceiling_bin_or_a_block_at_the_ceiling_strands_nothing():
    assert Preflight(4, [50, 30, 20, 0], tau=1.7).stranded_tokens_per_cycle == 0.0
    at_max = Preflight(MAX_BLOCK_SIZE, [0] * (MAX_BLOCK_SIZE - 1) + [10], tau=float(MAX_BLOCK_SIZE))
    assert at_max.stranded_tau_estimate == MAX_BLOCK_SIZE
    assert not at_max.recommendation()["expand"]


def test_a_partial_tail_by_hand():
    """B = 4, 100 cycles accepting 0/1/2/3 drafts 10/20/30/40 times: position rates 90/100, 70/90, 40/70,
    tail rate their mean r = 1417/1890; expansion to 6 adds two positions: 0.4 * (r + r^2)."""
    r = (Fraction(9, 10) + Fraction(7, 9) + Fraction(4, 7)) / 3
    assert r == Fraction(1417, 1890)
    report = Preflight(4, [10, 20, 30, 40], tau=3.0, max_block_size=6)
    assert report.tail_rate == pytest.approx(float(r))
    assert report.stranded_tokens_per_cycle == pytest.approx(float(Fraction(2, 5) * (r + r * r)), rel=1e-12)


def test_the_gauge_of_a_full_tail_stays_below_what_the_block_can_add():
    """The /metrics case: B = 12, one cycle in 95 in the ceiling bin, every position accepting."""
    histogram = [94] + [0] * 10 + [1]  # rates: 1/95, then 1.0 for the last positions
    report = Preflight(12, histogram, tau=1.12)
    extra = report.stranded_tokens_per_cycle
    assert extra <= report.ceiling_fraction * (MAX_BLOCK_SIZE - 12) + 1e-12
    assert extra < 1.0  # was 10.5
