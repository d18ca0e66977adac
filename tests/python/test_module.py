"""The compiled module and the exception classes, without a job."""

import builtins
import time

import pytest


@pytest.fixture
def gradlink(built):
    import gradlink
    return gradlink


CODES = {
    1: "InvalidArgumentError", 2: "TimeoutError", 3: "PeerLostError", 4: "ProtocolError",
    5: "MismatchError", 6: "AuthFailedError", 7: "AbortedError", 8: "ResourceExhaustedError",
    9: "UnavailableError", 10: "InternalError",
}


def test_status_codes_map_to_exception_classes(gradlink):
    for code, name in CODES.items():
        cls = getattr(gradlink, name)
        assert issubclass(cls, gradlink.GradlinkError)
        with pytest.raises(cls) as info:
            gradlink._gradlink._raise_status(code, "some message")
        assert type(info.value) is cls
        assert "some message" in str(info.value)
        assert cls.code == gradlink.code_name(code)


def test_builtin_bases(gradlink):
    assert issubclass(gradlink.TimeoutError, builtins.TimeoutError)
    assert issubclass(gradlink.InvalidArgumentError, ValueError)
    assert issubclass(gradlink.GradlinkError, RuntimeError)
    with pytest.raises(builtins.TimeoutError):
        gradlink._gradlink._raise_status(2, "late")


def test_connect_to_nothing_is_unavailable_in_bounded_time(gradlink):
    t0 = time.monotonic()
    with pytest.raises(gradlink.UnavailableError, match="127.0.0.1:1"):
        gradlink.Worker("127.0.0.1:1", connect_timeout=0.5)
    assert time.monotonic() - t0 < 10


def test_joining_an_address_where_no_job_runs_fails_fast_saying_so(gradlink):
    # The default connect timeout is 30 s; an address that refuses every connection for 5 s
    # (kRefusedGrace) has no job behind it: init() after the job ended says so.
    t0 = time.monotonic()
    with pytest.raises(gradlink.UnavailableError, match="no gradlink job is running there"):
        gradlink.Worker("127.0.0.1:1")
    assert time.monotonic() - t0 < 12


def test_worker_options_come_from_the_environment_through_the_cpp_mapping(gradlink, monkeypatch):
    # A malformed variable is refused by name before anything connects.
    monkeypatch.setenv("GRADLINK_PARTITION_BYTES", "4 MiB")
    with pytest.raises(gradlink.InvalidArgumentError, match="GRADLINK_PARTITION_BYTES='4 MiB'"):
        gradlink.Worker("127.0.0.1:1", connect_timeout=0.2)
    monkeypatch.delenv("GRADLINK_PARTITION_BYTES")
    # GRADLINK_SCHEDULER and GRADLINK_CONNECT_TIMEOUT apply when the arguments are left out.
    monkeypatch.setenv("GRADLINK_SCHEDULER", "127.0.0.1:1")
    monkeypatch.setenv("GRADLINK_CONNECT_TIMEOUT", "0.3")
    t0 = time.monotonic()
    with pytest.raises(gradlink.UnavailableError, match="127.0.0.1:1"):
        gradlink.Worker()
    assert time.monotonic() - t0 < 5
    # An argument given wins over its variable.
    monkeypatch.setenv("GRADLINK_SCHEDULER", "not-an-address")
    with pytest.raises(gradlink.UnavailableError, match="127.0.0.1:1"):
        gradlink.Worker("127.0.0.1:1")


def test_bad_arguments(gradlink):
    with pytest.raises(gradlink.InvalidArgumentError):
        gradlink.Worker("not-an-address", connect_timeout=0.2)
    with pytest.raises(gradlink.InvalidArgumentError):
        gradlink.dtype_size("fp8")
    assert gradlink.dtype_size("bf16") == 2


def test_torch_api_before_init_and_device_checks(gradlink):
    torch = pytest.importorskip("torch")
    import gradlink.torch as gl
    assert not gl.is_initialized()
    with pytest.raises(gradlink.InvalidArgumentError, match="init"):
        gl.rank()
    with pytest.raises(gradlink.InvalidArgumentError, match="init"):
        gl.push_pull(torch.ones(3), name="x")
    # Tensors neither on the CPU nor CUDA (here the 'meta' device) are refused with a clear
    # message; so are CUDA tensors where only CPU ones are taken (allgather).
    with pytest.raises(gradlink.InvalidArgumentError, match="meta tensors are not supported"):
        gl.push_pull(torch.ones(3, device="meta"), name="x")
    with pytest.raises(gradlink.InvalidArgumentError, match="meta tensors are not supported"):
        gl.allgather(torch.ones(3, device="meta"), name="x")
    with pytest.raises(TypeError):
        gl.push_pull([1.0, 2.0], name="x")


def test_init_without_scheduler(gradlink, monkeypatch):
    pytest.importorskip("torch")
    import gradlink.torch as gl
    for v in ("GRADLINK_SCHEDULER", "MASTER_ADDR", "RANK"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(gradlink.InvalidArgumentError, match="no scheduler"):
        gl.init()
