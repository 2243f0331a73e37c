"""provision over a Slurm cluster whose configs waited for a compute node's driver: once the
reboots have loaded the drivers, the same run plans the cluster again and applies what
waited (service.apply; the planners and the hosts are faked, the wiring is real)."""

from types import SimpleNamespace as NS

from torchrig.session import Result
from torchrig.provision import service
from torchrig.provision.apply import HostReport, StepResult

HOSTS = ["gpu1", "gpu2", "gpu3"]


class FakeFleet:
    def fan_out(self, fn, items, name=lambda h: h.name):
        return [Result(name(i), True, fn(i)) for i in items]


def planned(host, blocked=None, changes=True):
    return NS(host=NS(name=host), ctx=NS(cluster=NS(blocked=blocked)),
              plan=NS(changes_anything=changes, steps=[]), report=HostReport(host))


def first_pass(p, reboot, progress):
    waited = StepResult("slurm-config", "skipped", error="Slurm waits: gpu2: nvidia-smi does not answer yet")
    return HostReport(p.host.name, steps=[StepResult("driver", "changed"), waited],
                      rebooted=p.host.name != "gpu1")


def run(monkeypatch, rebooted_any=True):
    calls = []

    def apply_host(fleet, p, reboot, progress=None, meet=None, wheel_meet=None):
        calls.append((p.host.name, reboot))
        if len(calls) <= len(HOSTS):
            rep = first_pass(p, reboot, progress)
            rep.rebooted = rep.rebooted and rebooted_any
            return rep
        return HostReport(p.host.name, steps=[StepResult("driver", "ok"),
                                              StepResult("slurm-config", "changed", changes=["write"])])

    monkeypatch.setattr(service, "apply_host", apply_host)
    monkeypatch.setattr(service, "plan_hosts",
                        lambda fleet: [Result(h, True, planned(h)) for h in HOSTS])
    fp = service.FleetPlan([planned(h, blocked="gpu2: nvidia-smi does not answer yet") for h in HOSTS])
    return service.apply(FakeFleet(), fp, reboot=True), calls


def test_what_waited_for_the_drivers_runs_once_every_host_is_back(monkeypatch):
    res, calls = run(monkeypatch)
    # the second pass without reboots, on every host of the cluster
    assert calls[len(HOSTS):] == [(h, False) for h in HOSTS]
    for rep in res.reports:
        st = {s.name: s for s in rep.steps}
        assert st["slurm-config"].status == "changed" and st["driver"].status == "changed"
        assert rep.ok
    assert res.changed == 2 * len(HOSTS)


def test_no_reboot_no_second_pass(monkeypatch):
    res, calls = run(monkeypatch, rebooted_any=False)
    assert len(calls) == len(HOSTS)
    assert all({s.name: s for s in r.steps}["slurm-config"].status == "skipped" for r in res.reports)
