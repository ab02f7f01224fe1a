"""The set-up check that every DP replica holds the same parameters (sdp4bit.replicas), which
a bucket holding a whole model (Megatron's bucket_size=None) also goes through: it finds a
difference anywhere in the buckets, and the memory it takes does not grow with them."""

import replica_scenarios
import torch
from harness import run_ranks

from sdp4bit import replicas

#: A 32 MiB bf16 bucket, 16 chunks.
NUMEL = 16 << 20
#: What the check may take at once: its two int64 chunk tensors, and 4 MiB for the rest of
#: the process meanwhile (gloo's all-gather, Python).
BOUND = 16 * replicas.CHUNK + (4 << 20)


def test_the_checksum_is_the_whole_bucket_formula_in_chunks(monkeypatch):
    bits = torch.randint(-2**15, 2**15, (70_001,), dtype=torch.int16,
                         generator=torch.Generator().manual_seed(1))
    weights = torch.arange(1, bits.numel() + 1) % 65521 + 1
    whole = (bits.to(torch.int64) * weights).sum()
    for chunk in (1000, 65521, bits.numel(), 1 << 20):
        monkeypatch.setattr(replicas, "CHUNK", chunk)
        assert torch.equal(replicas._checksum(bits.view(torch.bfloat16)), whole), chunk


def test_a_difference_in_any_chunk_fails_every_rank():
    numel, chunk = 10_000, 1000
    # A bit flipped in the first chunk, a middle one, the last (partial) one, on either rank:
    # ranks are compared with rank 0, so at W = 2 the message names rank 1 either way.
    cases = [(None, 0), (1, 0), (1, 4321), (1, numel + 2), (0, numel - 1)]
    got = run_ranks(2, replica_scenarios.verdicts, numel, chunk, cases)
    for rank, messages in enumerate(got):
        for (differing, index), message in zip(cases, messages):
            if differing is None:
                assert message is None, (rank, message)
            else:
                assert "DP ranks [1] hold different parameters" in message, (rank, index, message)


def test_the_check_takes_one_chunk_of_memory_whatever_the_bucket():
    """The peak of each rank's resident set during the check of a 32 MiB bucket stays within
    the two chunk tensors; the control, the whole bucket checked as one chunk (temporaries that
    grow with the bucket, as the check's did before: 32 B/param then, 16 B/param here), is
    seen by the same measurement."""
    bounded = run_ranks(2, replica_scenarios.check_memory, NUMEL, replicas.CHUNK, "cpu")
    whole = run_ranks(2, replica_scenarios.check_memory, NUMEL, NUMEL, "cpu")
    print(f"replica check of {NUMEL} params: peak {[b / 2**20 for b in bounded]} MiB in "
          f"chunks of {replicas.CHUNK}, {[b / 2**20 for b in whole]} MiB as one chunk")
    assert all(0 < peak <= BOUND for peak in bounded), (bounded, BOUND)
    assert all(peak > 12 * NUMEL for peak in whole), whole

