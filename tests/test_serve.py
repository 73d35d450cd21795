"""``tta-bench serve``: the real FastAPI app on uvicorn (a background thread or the CLI in a
subprocess) on a free loopback port, called with httpx; the real default model and digits
images sent as PNG files."""

from __future__ import annotations

import io
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from processes import serve_cli

from tta_bench.deploy.adapter import Adapter
from tta_bench.deploy.serve import Limits, Service, running

pytest.importorskip("fastapi")


def _png(array: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def pngs():
    """Low-contrast digits test images as PNG bytes (adaptation has something to do)."""
    from mura_plugin.datasets.digits import digits_arrays

    x, _ = digits_arrays("test")
    x = x[:64].astype(np.float32)
    mean = x.mean(axis=(1, 2, 3), keepdims=True)
    low = ((x - mean) * 0.3 + mean).round().clip(0, 255).astype(np.uint8)
    return [_png(img) for img in low]


def _files(images: list[bytes]) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("image", (f"{i}.png", data, "image/png")) for i, data in enumerate(images)]


def _service(bundle, method: str = "zeroshot", overrides=None, token=None, **limits) -> Service:
    adapter = Adapter.from_bundle(
        bundle, dataset="digits", method=method, overrides=overrides, device="cpu"
    )
    return Service(adapter, Limits(**limits), token=token)


def _fresh(bundle, method: str, images: list[bytes], overrides=None):
    """A fresh standalone adapter's first prediction on ``images`` (decoded as the server)."""
    from PIL import Image

    adapter = Adapter.from_bundle(
        bundle, dataset="digits", method=method, overrides=overrides, device="cpu"
    )
    return adapter([Image.open(io.BytesIO(b)) for b in images])


def _scores(response: httpx.Response) -> tuple[list[str], torch.Tensor]:
    assert response.status_code == 200, response.text
    preds = response.json()["predictions"]
    return [p["label"] for p in preds], torch.tensor([p["score"] for p in preds])


def test_predict_adapts_like_a_fresh_adapter_and_leaves_no_state(default_bundle, pngs):
    images = pngs[:4]
    with (
        running(_service(default_bundle, "mura", ["views=15"])) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        assert client.get("/health").json() == {"status": "ok"}
        first = client.post("/predict?top_k=3", files=_files(images))
        labels, scores = _scores(first)
        body = first.json()
        assert body["session"] is None and body["method"] == "mura" and body["loss"] is not None
        row = body["predictions"][0]
        assert row["file"] == "0.png" and len(row["top_k"]) == 3
        assert row["top_k"][0] == {
            "label": row["label"],
            "index": row["index"],
            "score": row["score"],
        }
        expected = _fresh(default_bundle, "mura", images, ["views=15"])
        assert labels == expected.labels
        torch.testing.assert_close(scores, expected.scores, rtol=0, atol=1e-6)
        for _ in range(2):  # sessionless requests never see each other's adaptation
            again = _scores(client.post("/predict?top_k=3", files=_files(images)))
            assert again[0] == labels
            torch.testing.assert_close(again[1], scores, rtol=0, atol=1e-6)
        raw = client.post("/predict", content=images[0], headers={"content-type": "image/png"})
        assert _scores(raw)[0] == [expected.labels[0]]
        info = client.get("/info").json()
        assert info["method"] == "mura" and info["method_config"]["views"] == 15
        assert info["classnames"][:2] == ["zero", "one"] and info["model"]["image_size"] == 32
        assert info["limits"]["max_images"] == Limits().max_images
        assert "per-session lock" in info["concurrency"]["policy"]
        mem = info["memory"]
        assert 0 < mem["session_bytes_at_rest"] < mem["whole_model_copy_bytes"] / 10


def test_sessions_are_isolated_from_each_other_and_from_sessionless_requests(default_bundle, pngs):
    """Session A adapts heavily (Tent, large steps) while B and sessionless requests run:
    B and sessionless predictions equal a fresh adapter's; A's have moved."""
    overrides = {"lr": 0.05, "steps": 5}
    probe, stream = pngs[:8], pngs[8:]
    fresh = _fresh(default_bundle, "tent", probe, overrides)
    with (
        running(_service(default_bundle, "tent", overrides, workers=3)) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        a = client.post("/sessions").json()["session"]
        b = client.post("/sessions").json()["session"]
        assert a != b

        def adapt_a() -> None:
            with httpx.Client(base_url=url, timeout=60) as other:
                for i in range(0, len(stream), 8):
                    r = other.post(f"/predict?session={a}", files=_files(stream[i : i + 8]))
                    assert r.status_code == 200

        worker = threading.Thread(target=adapt_a)
        worker.start()
        session_b = client.post("/predict", files=_files(probe), headers={"X-TTA-Session": b})
        sessionless = client.post("/predict", files=_files(probe))
        worker.join(timeout=120)
        for response in (session_b, sessionless):
            labels, scores = _scores(response)
            assert labels == fresh.labels
            torch.testing.assert_close(scores, fresh.scores, rtol=0, atol=1e-6)
        moved = _scores(client.post(f"/predict?session={a}", files=_files(probe)))[1]
        assert not torch.allclose(moved, fresh.scores, atol=1e-3)  # A really adapted
        assert client.get(f"/sessions/{a}").json()["requests"] == 8
        assert client.post(f"/sessions/{a}/reset").json() == {"session": a, "reset": True}
        reset = _scores(client.post(f"/predict?session={a}", files=_files(probe)))[1]
        torch.testing.assert_close(reset, fresh.scores, rtol=0, atol=1e-6)
        assert client.delete(f"/sessions/{a}").json()["deleted"] is True
        gone = client.post(f"/predict?session={a}", files=_files(probe))
        assert gone.status_code == 404 and "unknown session" in gone.json()["detail"]


def test_requests_are_served_while_an_adaptation_runs(default_bundle, pngs):
    """A slow adaptation in session A (64 images x 64 views, 3 steps) holds one worker;
    /health, a sessionless request and a request of session B complete meanwhile."""
    service = _service(default_bundle, "mura", {"steps": 3}, workers=2)
    with running(service) as url, httpx.Client(base_url=url, timeout=120) as client:
        a = client.post("/sessions").json()["session"]
        b = client.post("/sessions").json()["session"]
        slow: dict[str, float] = {}

        def adapt_a() -> None:
            with httpx.Client(base_url=url, timeout=300) as other:
                r = other.post(f"/predict?session={a}", files=_files(pngs))
                slow["status"] = r.status_code
                slow["done"] = time.monotonic()

        worker = threading.Thread(target=adapt_a)
        worker.start()
        deadline = time.monotonic() + 60
        while not client.get(f"/sessions/{a}").json()["busy"]:
            assert time.monotonic() < deadline and worker.is_alive()
            time.sleep(0.01)
        assert client.get("/info").json()["load"]["computing"] >= 1
        assert client.get("/health").status_code == 200
        assert _scores(client.post("/predict", files=_files(pngs[:1])))[0]
        assert _scores(client.post(f"/predict?session={b}", files=_files(pngs[:1])))[0]
        other_done = time.monotonic()
        assert worker.is_alive(), "the slow adaptation must still be running"
        worker.join(timeout=300)
        assert slow["status"] == 200 and slow["done"] > other_done


def test_admission_limit_answers_503_while_busy(default_bundle, pngs):
    service = _service(default_bundle, "mura", {"steps": 3}, workers=1, max_pending=1)
    with running(service) as url, httpx.Client(base_url=url, timeout=120) as client:
        worker = threading.Thread(
            target=lambda: httpx.post(f"{url}/predict", files=_files(pngs[:32]), timeout=300)
        )
        worker.start()
        deadline = time.monotonic() + 60
        while client.get("/info").json()["load"]["pending"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        busy = client.post("/predict", files=_files(pngs[:1]))
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert "max-pending" in busy.json()["detail"]
        worker.join(timeout=300)


def test_bearer_token_guards_everything_but_health(default_bundle, pngs):
    with (
        running(_service(default_bundle, token="s3cret")) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        assert client.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for method, path in (
                ("GET", "/info"),
                ("POST", "/predict"),
                ("POST", "/sessions"),
                ("DELETE", "/sessions/x"),
                ("POST", "/sessions/x/reset"),
            ):
                r = client.request(method, path, headers=headers)
                assert r.status_code == 401, (method, path, headers)
                assert r.headers["www-authenticate"] == "Bearer"
                assert "Authorization: Bearer" in r.json()["detail"]
        good = {"Authorization": "Bearer s3cret"}
        assert client.get("/info", headers=good).json()["auth"] == "bearer"
        assert client.post("/predict", files=_files(pngs[:1]), headers=good).status_code == 200


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width x height`` RGB pixels followed by a few bytes of
    image data: a decompression bomb's shape (tiny file, huge declared image)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 4096)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_limits_answer_4xx_naming_the_limit(default_bundle, pngs):
    rng = np.random.default_rng(0)
    noise = _png(rng.integers(0, 256, (120, 120, 3), dtype=np.uint8))  # ~43 KB, 14,400 px
    service = _service(
        default_bundle,
        max_body_bytes=30_000,
        max_image_pixels=10_000,
        max_images=2,
        max_sessions=2,
        session_idle_s=600,  # none expires while the sessions' limit is checked
    )
    with running(service) as url, httpx.Client(base_url=url, timeout=60) as client:

        def post(**kw):
            return client.post("/predict", **kw)

        cases = [
            (post(files=_files([noise])), 413, "exceeds the limit of 30000 bytes"),
            (post(files=_files(pngs[:3])), 413, "the limit is 2 images"),
            (post(files=_files([_png_header_only(5000, 5000)])), 413, "25000000 pixels"),
            (post(files=_files([_png_header_only(100_000, 100_000)])), 413, "decompression"),
            (post(files=_files([b"not an image"])), 415, "accepted format (PNG, JPEG"),
            (post(files=_files([pngs[0][:60]])), 422, "cannot be decoded"),
            (post(content=b"x=1", headers={"content-type": "text/plain"}), 415, "Content-Type"),
            (post(data={"note": "hi"}, files=_files(pngs[:1])), 422, "unexpected form field"),
            (
                client.post("/predict?top_k=11", files=_files(pngs[:1])),
                422,
                "top_k must be in 1..10",
            ),
            (client.post("/predict?session=nope", files=_files(pngs[:1])), 404, "unknown session"),
        ]
        for response, status, message in cases:
            assert response.status_code == status, (message, response.text)
            assert message.lower() in response.json()["detail"].lower(), response.text
        assert client.post("/predict", files=_files(pngs[:2])).status_code == 200

        client.post("/sessions")
        client.post("/sessions")
        full = client.post("/sessions")
        assert full.status_code == 429 and "--max-sessions" in full.json()["detail"]
    # idle sessions expire and free their slots (a service of its own: with a timeout this
    # short, a loaded machine could expire a session while the limit above is checked)
    service = _service(default_bundle, max_sessions=1, session_idle_s=0.3)
    with running(service) as url, httpx.Client(base_url=url, timeout=60) as client:
        first = client.post("/sessions").json()["session"]
        time.sleep(0.7)  # idle for longer than the timeout: expired
        expired = client.post(f"/predict?session={first}", files=_files(pngs[:1]))
        assert expired.status_code == 404 and "expired" in expired.json()["detail"]
        assert client.get(f"/sessions/{first}").status_code == 404
        assert client.post("/sessions").status_code == 201  # the expired one freed its slot
        assert client.get("/info").json()["sessions"]["open"] == 1


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.slow
def test_cli_serves_with_a_token_file_until_ctrl_c_and_never_writes_uploads(tmp_path):
    """The installed command in a subprocess with ``--token-file`` and its temporary and
    cache directories pointed at empty folders: 401 without the token, 200 with it, the
    token nowhere in the process's command line; a 2.7 MB upload (Starlette would spool it
    to a temporary file past 1 MB) leaves no file anywhere in them; SIGINT stops it
    cleanly. (One process for both: each start of the service loads the model.)"""
    dirs = {name: tmp_path / name for name in ("tmp", "cache", "xdg")}
    for d in dirs.values():
        d.mkdir()
    token = tmp_path / "token"
    token.write_text("file-s3cret\n")
    token.chmod(0o600)
    env = {
        **os.environ,
        "TMPDIR": str(dirs["tmp"]),
        "TTA_BENCH_CACHE": str(dirs["cache"]),
        "XDG_CACHE_HOME": str(dirs["xdg"]),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("TTA_BENCH_SERVE_TOKEN", None)
    with serve_cli("--token-file", str(token), "--max-body-mb", "8", env=env) as (proc, url):
        assert b"file-s3cret" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        before = {name: _tree(d) for name, d in dirs.items()}
        rng = np.random.default_rng(1)
        big = _png(rng.integers(0, 256, (950, 950, 3), dtype=np.uint8))
        assert len(big) > 2_500_000
        good = {"Authorization": "Bearer file-s3cret"}
        with httpx.Client(base_url=url, timeout=120) as client:
            assert client.get("/info").status_code == 401
            info = client.get("/info", headers=good).json()
            assert info["auth"] == "bearer" and info["method"] == "zeroshot"
            files = [("image", ("big.png", big, "image/png"))]
            r = client.post("/predict", files=files, headers=good)
            assert r.status_code == 200, r.text
            assert r.json()["predictions"][0]["file"] == "big.png"
        assert {name: _tree(d) for name, d in dirs.items()} == before
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "stopped" in proc.stderr.read()


def test_missing_serve_extra_names_the_install_command():
    code = (
        "import sys; sys.modules['fastapi'] = None\n"
        "from tta_bench.cli import main\n"
        "sys.exit(main(['serve']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2
    assert "pip install 'tta-bench[serve]'" in done.stderr and "fastapi" in done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "mrua"], "Did you mean 'mura'"),
        (["--method", "tent", "stepz=2"], "unknown tent option(s) 'stepz'"),
        (["--workers", "0"], "serve.workers=0 is out of range: it must be > 0"),
        (["--dataset", "digitz"], "unknown dataset 'digitz'"),
    ],
)
def test_bad_serve_arguments_exit_2(capsys, monkeypatch, args, message):
    from tta_bench.cli import main

    monkeypatch.delenv("TTA_BENCH_SERVE_TOKEN", raising=False)  # --no-auth refuses a token

    assert main(["serve", "--port", "0", "--no-auth", *args]) == 2
    assert message in capsys.readouterr().err
