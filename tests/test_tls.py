"""HTTPS with uvicorn's own TLS (--ssl-certfile/--ssl-keyfile), and the router trusting
https:// workers through --ssl-ca-certs. Certificates come from a throwaway CA (trustme);
servers run in this process, uvicorn on a thread."""
from __future__ import annotations

import ssl

import httpx
import pytest
import trustme
from fastapi import FastAPI, Request

from kvrelay.core.clock import MonotonicClock
from kvrelay.core.config import RouterConfig, SecurityConfig, ServerConfig
from kvrelay.core.keys import ClusterKey
from kvrelay.server.errors import StartupError
from kvrelay.server.router import worker_table
from kvrelay.server.security import api_gate, auth_headers, check_tls, worker_verify
from kvrelay.server.startup import serving_url, uvicorn_options
from kvrelay.server.worker_client import LegFailure, WorkerAPI
from api_helpers import serving

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA and a server certificate for 127.0.0.1 and localhost, as PEM files."""
    root = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {"ca": root / "ca.pem", "cert": root / "server.pem", "key": root / "server.key"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    for i, blob in enumerate(cert.cert_chain_pems):
        blob.write_to_path(str(paths["cert"]), append=i > 0)
    cert.private_key_pem.write_to_path(str(paths["key"]))
    return {name: str(p) for name, p in paths.items()}


def tls(pki, **more) -> SecurityConfig:
    return SecurityConfig(ssl_certfile=pki["cert"], ssl_keyfile=pki["key"], **more)


def test_https_options_and_urls(pki):
    srv = ServerConfig(host="0.0.0.0", port=8443)
    assert serving_url(srv, SecurityConfig()) == "http://0.0.0.0:8443"
    assert serving_url(srv, tls(pki)) == "https://0.0.0.0:8443"
    assert "ssl_certfile" not in uvicorn_options(srv, SecurityConfig())
    opts = uvicorn_options(srv, tls(pki, ssl_ca_certs=pki["ca"]))
    assert (opts["ssl_certfile"], opts["ssl_keyfile"]) == (pki["cert"], pki["key"])
    assert "ssl_ca_certs" not in opts   # that one is what the router trusts, not client-certificate checking
    check_tls(tls(pki, ssl_ca_certs=pki["ca"]))
    assert worker_table(RouterConfig(prefill=("https://10.0.0.1:8100",), decode=("http://10.0.0.2:8200",)),
                        MonotonicClock()).urls() == ["https://10.0.0.1:8100", "http://10.0.0.2:8200"]


@pytest.mark.parametrize("broken", [dict(ssl_certfile="/nonexistent.pem", ssl_keyfile="/nonexistent.key"),
                                    dict(ssl_ca_certs="/nonexistent-ca.pem"), "key is the certificate"])
def test_unreadable_tls_files_fail_start_up_with_one_line(pki, broken):
    sec = (SecurityConfig(ssl_certfile=pki["cert"], ssl_keyfile=pki["ca"]) if isinstance(broken, str)
           else SecurityConfig(**broken))
    with pytest.raises(StartupError, match="cannot load the TLS files"):
        check_tls(sec)


def test_the_api_over_https_is_trusted_only_by_clients_that_trust_its_ca(tiny_engine, pki):
    from kvrelay.server.colocated import colocated_app

    sec = tls(pki, api_key=("tls-key",))
    with serving(colocated_app(tiny_engine, api_gate(sec, {})), sec) as url:
        assert url.startswith("https://127.0.0.1:")
        trusting = ssl.create_default_context(cafile=pki["ca"])
        with httpx.Client(base_url=url, verify=trusting, timeout=60) as c:
            assert c.get("/health").json()["status"] == "ok"
            assert c.get("/v1/models").status_code == 401
            r = c.post("/v1/completions", json={"prompt": "over TLS", "max_tokens": 3, "ignore_eos": True},
                       headers={"Authorization": "Bearer tls-key"})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        with httpx.Client(base_url=url, timeout=30) as untrusting:   # the system's CAs only
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                untrusting.get("/health")
        with pytest.raises(httpx.HTTPError):   # plain HTTP to the TLS port gets no answer
            httpx.get(url.replace("https://", "http://") + "/health", timeout=10)
    tiny_engine.check_idle()


async def test_the_router_trusts_https_workers_through_ssl_ca_certs(pki):
    """WorkerAPI (and so the health checks, legs and aborts) verifies an https:// worker
    against --ssl-ca-certs, and presents the cluster token there too."""
    key = ClusterKey.generate()
    seen: list[str | None] = []
    worker = FastAPI()

    @worker.get("/health")
    async def health(request: Request) -> dict:
        seen.append(request.headers.get("authorization"))
        return {"role": "prefill", "worker_id": "w", "incarnation": "i", "model": "m", "max_model_len": 64,
                "transfer_backend": "tcp", "transfer_address": "tcp://127.0.0.1:1", "live_requests": 0,
                "queued_requests": 0, "free_pages": 4, "total_pages": 4, "auth": "ok"}

    sec = tls(pki, ssl_ca_certs=pki["ca"])
    with serving(worker, sec) as url:
        trusting = WorkerAPI(RouterConfig(), headers=auth_headers(key), verify=worker_verify(sec))
        untrusting = WorkerAPI(RouterConfig(), headers=auth_headers(key), verify=worker_verify(SecurityConfig()))
        try:
            assert (await trusting.health(url)).total_pages == 4
            with pytest.raises(LegFailure, match="CERTIFICATE_VERIFY_FAILED"):
                await untrusting.health(url)
        finally:
            await trusting.close()
            await untrusting.close()
    assert seen == [f"Bearer {key.http_token}"]
