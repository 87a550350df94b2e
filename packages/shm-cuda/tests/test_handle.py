import pickle

import pytest
import shm_cuda
from shm_cuda import CudaArrayHandle, HandleError, RegistryRef

REF = RegistryRef(pid=123, start=456, seg_id=789, fd=5)


def handle(**kw):
    base = dict(ipc_handle=b"\x01" * 64, block_size=4096, offset=512, shape=(4, 8), strides=(32, 4),
                dtype="<f4", device_uuid=b"\x02" * 16, event_handle=b"\x03" * 64, producer_pid=123,
                registry=REF, slot=7, generation=3, token=11)
    base.update(kw)
    return CudaArrayHandle(**base)


def test_round_trip():
    h = handle()
    h2 = pickle.loads(pickle.dumps(h))
    assert h2 == h and h2.key == (b"\x02" * 16, b"\x01" * 64)
    assert h2.validate().str == "<f4"
    assert pickle.loads(pickle.dumps(handle(event_handle=None))).event_handle is None


@pytest.mark.parametrize("kw, words", [
    (dict(dtype="nonsense"), "unknown dtype"),
    (dict(dtype="O"), "cannot live in device memory"),
    (dict(ipc_handle=b"x"), "64 bytes"),
    (dict(event_handle=b"x" * 3), "event handle"),
    (dict(device_uuid=b"x"), "UUID"),
    (dict(strides=(4,)), "2 dimensions but 1 strides"),
    (dict(shape=(-1, 8)), "bad shape"),
    (dict(offset=5000), "outside the 4096-byte"),
    (dict(offset=-8), "outside"),
    (dict(shape=(200, 8)), "reaches bytes"),
    (dict(offset=64, strides=(-32, 4)), "reaches bytes"),
])
def test_validation_errors(kw, words):
    with pytest.raises(HandleError, match=words):
        handle(**kw).validate()


def test_edges_valid():
    handle(offset=4096 - 128, shape=(4, 8)).validate()  # ends exactly at the block's end
    handle(offset=4096, shape=(0, 8)).validate()  # empty
    handle(offset=96, strides=(-32, 4)).validate()  # negative stride reaching byte 0
    assert issubclass(HandleError, ValueError) and issubclass(HandleError, shm_cuda.ShmCudaError)
