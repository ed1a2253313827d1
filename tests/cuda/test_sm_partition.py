"""SM partitions (green contexts) on a GPU: the two sides run on disjoint SMs.

Skipped without a CUDA GPU or CuPy, or where the driver has no green contexts.
"""

import pytest
import torch

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
cupy = pytest.importorskip("cupy")

from hicache.transfer.sm_partition import SmPartition  # noqa: E402

_SMID = r"""
extern "C" __global__ void smid(int* out) {
    if (threadIdx.x == 0) {
        unsigned s;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
        out[blockIdx.x] = (int)s;
    }
    for (volatile int i = 0; i < 20000; i++) {}  // stay resident, so blocks spread over the SMs allowed
}
"""


def _sms_used(stream: torch.cuda.Stream, blocks: int) -> set[int]:
    fn = cupy.RawModule(code=_SMID).get_function("smid")
    out = cupy.full(blocks, -1, dtype=cupy.int32)
    with cupy.cuda.ExternalStream(stream.cuda_stream):
        fn((blocks,), (128,), (out,))
    stream.synchronize()
    return set(out.get().tolist())


def _partition(reserve: int) -> SmPartition:
    try:
        return SmPartition(torch.device("cuda", 0), reserve)
    except OSError as e:
        pytest.skip(f"no green contexts: {e}")


def test_reserved_and_compute_sms_are_disjoint() -> None:
    part = _partition(8)
    try:
        total = torch.cuda.get_device_properties(0).multi_processor_count
        assert part.total_sms == total
        assert part.reserved_sms >= 8
        assert part.reserved_sms + part.compute_sms <= total
        blocks = 8 * total
        mine = _sms_used(part.stream(), blocks)
        theirs = _sms_used(part.compute_stream(), blocks)
        assert -1 not in mine and -1 not in theirs
        assert len(mine) <= part.reserved_sms
        assert len(theirs) <= part.compute_sms
        assert not mine & theirs
        # on an ordinary stream a kernel may use every SM, the reserved ones included
        everyone = _sms_used(torch.cuda.Stream(), blocks)
        assert len(everyone) > part.compute_sms
        assert part.compute_stream() is part.compute_stream()
    finally:
        part.close()
    part.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        part.stream()


def test_torch_work_and_events_cross_the_partition() -> None:
    part = _partition(8)
    try:
        a = torch.randn(512, 512, device="cuda")
        comp, mine = part.compute_stream(), part.stream()
        with torch.cuda.stream(comp):
            torch.cuda._sleep(50_000_000)
            b = a @ a
            done = torch.cuda.Event()
            done.record()
        mine.wait_event(done)
        with torch.cuda.stream(mine):
            c = b + 1
        mine.synchronize()
        assert torch.allclose(c, a @ a + 1)
    finally:
        torch.cuda.synchronize()
        part.close()


def test_asking_for_every_sm_fails_cleanly() -> None:
    total = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises((RuntimeError, OSError)):
        SmPartition(torch.device("cuda", 0), total + 8)
    with pytest.raises(ValueError, match="reserve"):
        SmPartition(torch.device("cuda", 0), 0)
