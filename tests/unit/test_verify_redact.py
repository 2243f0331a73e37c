"""verify prints what hosts said (tool output, error lines): its table and --json go through
the one redactor like every other output."""

import json

from torchrig.secrets import Redactor
from torchrig.verify.evaluate import Check, HostVerdict
from torchrig.verify.run import VerifyReport


def test_verify_report_texts_are_redacted(capsys):
    red = Redactor(["hunter2-tok"])
    v = HostVerdict("gpu1", checks=[Check("pip", "FAIL", "GET https://ci:p@ss@idx/simple: 401")],
                    advice=["retry with hunter2-tok"])
    bw = {"scope": "gpu1", "hosts": ["gpu1"], "check": Check("busbw", "FAIL", "token hunter2-tok"),
          "result": None}
    rep = VerifyReport(hosts=[v], unreachable={"gpu2": "cannot fetch https://:only-t0ken@h/x"},
                 bandwidth=[bw])
    rep.redact(red)
    from torchrig import tables
    tables.verify_report(rep)
    out = capsys.readouterr().out + json.dumps(red.data(rep.as_dict()), default=str)
    for secret in ("p@ss", "hunter2-tok", "only-t0ken"):
        assert secret not in out
    assert "401" in out and "gpu2" in out


def test_verify_service_keeps_the_sweeps_only_with_bandwidth_and_redacts(monkeypatch):
    """`torchrig verify`'s one call: the report redacted; the sweeps kept here (for `torchrig
    report`) only when --bandwidth measured them, with the hosts' addresses."""
    import types
    from torchrig.verify import run, service, store

    bw = {"scope": "gpu1", "hosts": ["gpu1"], "check": Check("busbw", "FAIL", "token hunter2-tok"),
          "result": None}
    monkeypatch.setattr(run, "verify", lambda fleet, hosts, bandwidth, diag=None: VerifyReport(
        bandwidth=[bw] if bandwidth else []))
    saved = []
    monkeypatch.setattr(store, "save", lambda bandwidth, addresses: saved.append(
        (bandwidth, addresses)))
    fleet = types.SimpleNamespace(hosts=[types.SimpleNamespace(name="gpu1", address="10.0.0.1")])
    assert service.verify(fleet).bandwidth == [] and saved == []
    rep = service.verify(fleet, bandwidth=True, red=Redactor(["hunter2-tok"]))
    assert saved == [([bw], {"gpu1": "10.0.0.1"})]
    assert "hunter2-tok" not in rep.bandwidth[0]["check"].detail
