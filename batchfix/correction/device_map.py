"""The corrected counts' quantile map (batchfix.correction.counts) in torch, on the tensors' device (CPU threads or
CUDA): the same draws and, but for draws within float rounding of a quantile boundary, the same counts as
`counts.counter_uniform` and `counts.quantile_map`.

- `counter_uniform_torch`: SplitMix64 on int64 tensors (wrapping multiplication; a logical right shift is an
  arithmetic one with the copied sign bits cleared), bit for bit the numpy draws.
- `quantile_map_torch`, in two passes:
  1. every entry: a bound without exp, log or pow (`may_move`, on the CPU by blocks of CPU_BLOCK entries) settles
     most zeros at 0; the rest, and the positive counts, are gathered.
  2. the gathered entries: counts.quantile_map's closed form for zeros (a zero stays 0 where u F_own(0) <=
     F_ref(0)); counts up to WALK_STEPS by the pmf walk of counts.walk_tails and counts.walk_quantile, each step
     one set of tensor operations over all walked entries, numpy's operations in numpy's order. What the walk
     does not settle (counts above WALK_STEPS, the far upper tail, P(0) below exp(LOG_PMF_FLOOR), quantiles above
     WALK_STEPS) takes the documented method for large counts, counts.exact_quantile_map (scipy's incomplete beta
     function), on the CPU for just those entries: they are rare in single-cell counts.

Where a count may differ from numpy's: F(0) is exp(theta log p), as numpy's walk takes it, where numpy's closed form
takes pow(p, theta); and torch's exp and log may round the last bit otherwise than numpy's (on CUDA more often).
Each moves a count only where its draw lies within float rounding of a quantile boundary. The walks divide by k + 1
held in a tensor on the device: CUDA divides by a CPU scalar through its reciprocal, which would round otherwise.
"""
from __future__ import annotations

import numpy as np
import torch

from batchfix.correction import counts

UINT64 = 1 << 64
SPLITMIX_GAMMA = int(counts.SPLITMIX_GAMMA)
SPLITMIX_STEPS = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None))  # (shift, multiplier)
CPU_BLOCK = 1 << 18  # entries per block of the passes over every entry on the CPU
SCREEN_MARGIN = 1e-9  # relative margin of `may_move`'s bound, far above the rounding of either side
COMPACT_AT = frozenset((1, 3, 7, 15, 31))  # walk steps after which finished entries are dropped


def _signed(value: int) -> int:
    """The int64 of the same 64 bits as the unsigned `value` (taken modulo 2^64)."""
    value %= UINT64
    return value - UINT64 if value >= 1 << 63 else value


def _where(mask: torch.Tensor) -> torch.Tensor:
    """(k,) int64 positions of the True entries of the flat `mask` (numpy's on the CPU: about twice as fast)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return torch.nonzero(mask).squeeze(1)


def _take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values[index] of a flat tensor (index_select: several times faster than indexing on the CPU)."""
    return torch.index_select(values, 0, index)


def _run_blocks(function, n: int, block: int, device: torch.device) -> None:
    """function(part) for slices of `block` of range(n) on the CPU (each slice's temporaries stay in the cache, and
    torch's threads share each operation), for one slice of all n elsewhere."""
    step = block if device.type == "cpu" else max(n, 1)
    for start in range(0, n, step):
        function(slice(start, min(start + step, n)))


def _splitmix64_(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function, in place, on int64 tensors holding uint64 bits (wrapping arithmetic)."""
    shifted = torch.empty_like(x)
    for bits, multiplier in SPLITMIX_STEPS:
        torch.bitwise_right_shift(x, bits, out=shifted)
        shifted &= (1 << (64 - bits)) - 1  # the logical shift: the copied sign bits cleared
        x ^= shifted
        if multiplier is not None:
            x *= _signed(multiplier)
    return x


def _key_tensor(keys, device) -> torch.Tensor:
    """(n,) int64 tensor of the uint64 `keys` (numpy uint64 as from counts.name_keys, or an int64 tensor)."""
    if isinstance(keys, torch.Tensor):
        return keys.to(device=device, dtype=torch.int64)
    return torch.from_numpy(np.ascontiguousarray(keys, dtype=np.uint64).view(np.int64)).to(device)


def counter_uniform_torch(seed: int, cell_keys, gene_keys, device="cpu") -> torch.Tensor:
    """(len(cell_keys), len(gene_keys)) float64 uniforms in (0, 1) on `device`: bit for bit counts.counter_uniform."""
    device = torch.device(device)
    cells, genes = _key_tensor(cell_keys, device), _key_tensor(gene_keys, device)
    key = _splitmix64_(cells + _signed(seed * SPLITMIX_GAMMA + SPLITMIX_GAMMA))
    gene_mix = _splitmix64_(genes + _signed(SPLITMIX_GAMMA))
    out = torch.empty((len(cells), len(genes)), dtype=torch.float64, device=device)

    def fill(rows: slice) -> None:
        mixed = _splitmix64_(key[rows, None] ^ gene_mix[None, :])  # (rows, genes)
        out[rows] = torch.bitwise_right_shift(mixed, 11) & ((1 << 53) - 1)
        out[rows] += 0.5
        out[rows] /= float(1 << 53)

    _run_blocks(fill, len(cells), max(1, CPU_BLOCK // max(1, len(genes))), device)
    return out


def may_move(y: torch.Tensor, own_mean: torch.Tensor, ref_mean: torch.Tensor, own_theta: torch.Tensor,
             u: torch.Tensor) -> torch.Tensor:
    """(n,) bool: False where a zero surely stays 0, True for positive counts and the zeros left to the closed form.

    A zero stays where u F_own(0) <= F_ref(0). With log F_ref(0) >= -ref_mean, log F_own(0) <= -own_mean p_own
    (log(1 + x) lies between x / (1 + x) and x) and log u <= u - 1, it surely does where
    u + ref_mean - own_mean p_own <= 1, here with SCREEN_MARGIN to spare. Most zeros (a small mean, a draw not
    close to 1) are settled by it."""
    bound = torch.add(u, ref_mean, alpha=1.0 + SCREEN_MARGIN)
    bound.addcdiv_(own_mean * own_theta, own_theta + own_mean, value=-1.0)
    return (bound > 1.0 - SCREEN_MARGIN).logical_or_(y > 0)


def walk_tails_torch(y: torch.Tensor, p0: torch.Tensor, theta: torch.Tensor,
                     q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(F(y - 1), P(y)) of NB(theta, p) at ascending counts y (P(0) = p0, q = 1 - p), by counts.walk_tails's
    recurrence in its order of operations. Step k updates only the suffix of counts above k, so each entry stops at
    its own y."""
    tail, mass = torch.zeros_like(y), p0.clone()  # F(k - 1) and P(k) along the walk
    if not len(y):
        return tail, mass
    steps = torch.arange(int(y[-1].item()) + 1, dtype=y.dtype, device=y.device)  # also each step's k + 1
    for k, start in enumerate(torch.searchsorted(y, steps[:-1], right=True).tolist()):  # start: the first y above k
        tail[start:] += mass[start:]  # F(k)
        mass[start:] = mass[start:] * q[start:] * (theta[start:] + k) / steps[k + 1]  # P(k + 1)
    return tail, mass


def walk_quantile_torch(target: torch.Tensor, p0: torch.Tensor, theta: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The smallest k with F(k) >= target under NB(theta, p) (P(0) = p0, q = 1 - p), by counts.walk_quantile's
    recurrence and order of operations; NaN where that k is above WALK_STEPS. F only grows along the walk, so the
    answer is the number of steps with F(k) below the target: finished entries need no stopping, and are dropped
    now and then (COMPACT_AT)."""
    result = torch.full_like(target, float("nan"))
    rows = torch.arange(len(target), device=target.device)
    current, tail = p0.clone(), torch.zeros_like(target)
    short = torch.zeros(len(target), dtype=torch.int32, device=target.device)  # steps with F(k) < target
    steps = torch.arange(counts.WALK_STEPS + 2, dtype=target.dtype, device=target.device)  # each step's k + 1
    for k in range(counts.WALK_STEPS + 1):
        tail += current  # F(k)
        short += tail < target
        if k in COMPACT_AT:
            finished, keep = _where(short <= k), _where(short > k)  # finished: reached at or before step k
            result.index_copy_(0, _take(rows, finished), _take(short, finished).to(result.dtype))
            rows, tail, target, short, theta, q, current = (
                _take(values, keep) for values in (rows, tail, target, short, theta, q, current))
            if not len(rows):
                break
        if k < counts.WALK_STEPS:
            current = current * q * (theta + k) / steps[k + 1]  # P(k + 1)
    reached = _where(short <= counts.WALK_STEPS)
    result.index_copy_(0, _take(rows, reached), _take(short, reached).to(result.dtype))
    return result


def walked_counts(y: torch.Tensor, u: torch.Tensor, own_p0: torch.Tensor, own_theta: torch.Tensor,
                  own_q: torch.Tensor, ref_p0: torch.Tensor, ref_theta: torch.Tensor,
                  ref_q: torch.Tensor) -> torch.Tensor:
    """counts.quantile_map's pmf walk of ascending counts y up to WALK_STEPS (P(0) of each NB given, above
    exp(LOG_PMF_FLOOR): callers check): the mapped counts, NaN where the walk does not settle them (the far upper
    tail, a quantile above WALK_STEPS)."""
    below, mass = walk_tails_torch(y, own_p0, own_theta, own_q)
    inner = 1.0 - (below + mass) >= counts.WALK_TAIL_FLOOR  # away from the far upper tail
    walked = walk_quantile_torch(below + u * mass, ref_p0, ref_theta, ref_q)
    return torch.where(inner, walked, float("nan"))


def may_move_blocks(y: torch.Tensor, own_mean: torch.Tensor, ref_mean: torch.Tensor, own_theta: torch.Tensor,
                    u: torch.Tensor) -> torch.Tensor:
    """(n,) bool `may_move` of every entry, by blocks of CPU_BLOCK on the CPU."""
    keep = torch.empty(len(y), dtype=torch.bool, device=y.device)

    def screen(part: slice) -> None:
        keep[part] = may_move(y[part], own_mean[part], ref_mean[part], own_theta[part], u[part])

    _run_blocks(screen, len(y), CPU_BLOCK, y.device)
    return keep


def gathered(y: torch.Tensor, own_mean: torch.Tensor, ref_mean: torch.Tensor, own_theta: torch.Tensor,
             ref_theta: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(rows, [y, own_mean, ref_mean, own_theta, ref_theta, u] at rows) of the entries `may_move` keeps, ordered by
    ascending count (counts above 255 last, in any order)."""
    rows = _where(may_move_blocks(y, own_mean, ref_mean, own_theta, u))
    values = [_take(values, rows) for values in (y, own_mean, ref_mean, own_theta, ref_theta, u)]
    order = torch.sort(values[0].clamp(max=255).to(torch.uint8), stable=True).indices
    return _take(rows, order), [_take(v, order) for v in values]


def map_gathered(y: torch.Tensor, own_mean: torch.Tensor, ref_mean: torch.Tensor, own_theta: torch.Tensor,
                 ref_theta: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """counts.quantile_map of entries in ascending count order (as `gathered` leaves them)."""
    own_sum, ref_sum = own_theta + own_mean, ref_theta + ref_mean
    own_p, ref_p, own_q, ref_q = own_theta / own_sum, ref_theta / ref_sum, own_mean / own_sum, ref_mean / ref_sum
    own_log0, ref_log0 = own_theta * torch.log(own_p), ref_theta * torch.log(ref_p)  # log P(0)
    own_p0, ref_p0 = torch.exp(own_log0), torch.exp(ref_log0)
    moving = (y > 0) | (u * own_p0 > ref_p0)  # counts.quantile_map's closed form, F(0) as exp(theta log p)
    small = int(torch.searchsorted(y, torch.tensor([float(counts.WALK_STEPS)], dtype=y.dtype, device=y.device),
                                   right=True).item())  # counts up to WALK_STEPS come first
    result = torch.full_like(y, float("nan"))
    result[:small] = walked_counts(*(values[:small] for values in (y, u, own_p0, own_theta, own_q, ref_p0,
                                                                   ref_theta, ref_q)))
    walkable = (own_log0 > counts.LOG_PMF_FLOOR) & (ref_log0 > counts.LOG_PMF_FLOOR)  # no underflow on the way
    result = torch.where(moving, torch.where(walkable, result, float("nan")), 0.0)
    exact = _where(torch.isnan(result))
    if len(exact):
        arrays = [_take(values, exact).cpu().numpy() for values in (y, own_mean, own_theta, own_p, own_q, ref_mean,
                                                                     ref_theta, ref_p, ref_q, u)]
        result.index_copy_(0, exact, torch.from_numpy(counts.exact_quantile_map(*arrays)).to(result.device))
    return result


def quantile_map_torch(y: torch.Tensor, own_mean: torch.Tensor, ref_mean: torch.Tensor, own_theta: torch.Tensor,
                       ref_theta: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """counts.quantile_map on flat float64 tensors of one device (integer counts y): y moved from
    NB(own_mean, own_theta) to the same randomised quantile u of NB(ref_mean, ref_theta), on that device. Large
    counts, the far upper tail and P(0) underflow take counts.exact_quantile_map on the CPU."""
    if y.dtype != torch.float64:
        raise TypeError(f"quantile_map_torch maps float64 tensors, not {y.dtype}")
    rows, values = gathered(y, own_mean, ref_mean, own_theta, ref_theta, u)
    return torch.zeros_like(y).index_copy_(0, rows, map_gathered(*values))
