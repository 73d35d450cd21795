"""An online MuRA behind ``tta-bench serve``: a session keeps its adapted components across
its requests (on both towers), other sessions and sessionless requests never see them, and
the service's reset policy (``session_reset_every``) or ``POST /sessions/{id}/reset`` puts
a session back at the state after setup."""

from __future__ import annotations

import httpx
import pytest
import torch
from test_serve import _files, _fresh, _scores, _service, pngs  # noqa: F401 - fixture

from tta_bench.deploy.serve import Service, running

pytest.importorskip("fastapi")

#: An online MuRA on both towers taking large steps, so that adaptation shows in a request.
ONLINE = {"episodic": "online", "towers": "both", "views": 3, "lr": 0.02, "steps": 2}


def test_online_mura_sessions_keep_their_own_state(default_bundle, pngs):  # noqa: F811
    probe, stream = pngs[:8], pngs[8:24]
    fresh = _fresh(default_bundle, "mura", probe, ONLINE)
    with (
        running(_service(default_bundle, "mura", ONLINE, workers=2)) as url,
        httpx.Client(base_url=url, timeout=120) as client,
    ):
        a = client.post("/sessions").json()["session"]
        b = client.post("/sessions").json()["session"]
        for i in range(0, len(stream), 8):  # session A adapts on 16 images
            r = client.post(f"/predict?session={a}", files=_files(stream[i : i + 8]))
            assert r.status_code == 200 and r.json()["session_reset"] is False
        for response in (
            client.post(f"/predict?session={b}", files=_files(probe)),
            client.post("/predict", files=_files(probe)),
        ):  # B's first request and a sessionless one start from setup, as a fresh adapter
            labels, scores = _scores(response)
            assert labels == fresh.labels
            torch.testing.assert_close(scores, fresh.scores, rtol=0, atol=1e-6)
        moved = _scores(client.post(f"/predict?session={a}", files=_files(probe)))[1]
        assert not torch.allclose(moved, fresh.scores, atol=1e-3)  # A kept its adaptation
        assert client.get(f"/sessions/{a}").json()["requests"] == 3
        assert client.post(f"/sessions/{a}/reset").json()["reset"] is True
        reset = _scores(client.post(f"/predict?session={a}", files=_files(probe)))[1]
        torch.testing.assert_close(reset, fresh.scores, rtol=0, atol=1e-6)
        assert client.get("/info").json()["sessions"]["reset_every_requests"] is None


def test_reset_policy_resets_a_session_after_every_n_requests(default_bundle, pngs):  # noqa: F811
    probe = pngs[:8]
    fresh = _fresh(default_bundle, "mura", probe, ONLINE)
    service = _service(default_bundle, "mura", ONLINE)
    service = Service(service.template, service.limits, session_reset_every=2)
    with running(service) as url, httpx.Client(base_url=url, timeout=120) as client:
        assert client.get("/info").json()["sessions"]["reset_every_requests"] == 2
        s = client.post("/sessions").json()["session"]
        first = client.post(f"/predict?session={s}", files=_files(probe))
        second = client.post(f"/predict?session={s}", files=_files(probe))
        assert first.json()["session_reset"] is False and second.json()["session_reset"] is True
        torch.testing.assert_close(_scores(first)[1], fresh.scores, rtol=0, atol=1e-6)
        assert not torch.allclose(_scores(second)[1], fresh.scores, atol=1e-3)
        assert client.get(f"/sessions/{s}").json()["requests"] == 0
        third = client.post(f"/predict?session={s}", files=_files(probe))  # after the reset
        torch.testing.assert_close(_scores(third)[1], fresh.scores, rtol=0, atol=1e-6)


@pytest.mark.parametrize("every", [0, -3, 1.5, True, "2"])
def test_bad_reset_policy_is_refused_naming_it(default_bundle, every):
    template = _service(default_bundle, "zeroshot").template
    with pytest.raises(ValueError, match="session_reset_every"):
        Service(template, session_reset_every=every)


def test_bad_reset_policy_exits_2_before_the_model_is_built(capsys):
    from tta_bench.cli import main

    # the misspelt method shows nothing was resolved or built before the policy was checked
    assert main(["serve", "--port", "0", "--no-auth", "--method", "mrua",
                 "--session-reset-every", "0"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "--session-reset-every" in err and "got 0" in err and "mrua" not in err
