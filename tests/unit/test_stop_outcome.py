"""stop: a node without the job is not a failure; no node with it is the error."""

import pytest

from torchrig.errors import TorchrigError
from torchrig.inventory import Host
from torchrig.launch.run import nowhere
from torchrig.session import Result
from torchrig.session import Outcome


def _hosts(*names):
    return [Host.model_construct(name=n) for n in names]


def test_a_job_on_two_of_three_hosts_stops_without_failing():
    """The README's quick start: launch --nodes 2 in a 3-host inventory, then stop --job."""
    out = Outcome("stop of job j", [Result("gpu1", True, "inactive"), Result("gpu2", True, "failed"),
                                    Result("gpu3", True, None)])
    assert nowhere(out, "j", _hosts("gpu1", "gpu2", "gpu3")) is out and out.ok


def test_no_selected_host_with_the_job_is_one_error():
    out = Outcome("stop of job nosuchjob", [Result("gpu1", True, None), Result("gpu2", True, None)])
    with pytest.raises(TorchrigError) as e:
        nowhere(out, "nosuchjob", _hosts("gpu1", "gpu2"))
    assert str(e.value).startswith("no job 'nosuchjob' on gpu1, gpu2; nothing was stopped")


def test_a_host_that_failed_is_still_a_failure():
    out = Outcome("stop of job j", [Result("gpu1", True, None), Result("gpu2", False, None, "x")])
    assert nowhere(out, "j", _hosts("gpu1", "gpu2")) is out and not out.ok
