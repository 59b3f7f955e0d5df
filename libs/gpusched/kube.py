"""The Kubernetes API as a pod sees it: the service-account token, the cluster's CA, JSON in and
out. Only what gpusched's pods do with it: the node daemon reads its Node's labels
(`nodeagent/topology_source.py`), the chart's bootstrap Job reads and writes the trust store's
Secrets (`security/k8s_secrets.py`). Each caller's RBAC is narrow; a 403 says which verb it lacks.
"""

from __future__ import annotations

import json
import os
import ssl
from pathlib import Path
from typing import Any

import aiohttp

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeError(Exception):
    """An API call that did not succeed: `status` is the HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


def api_server() -> str:
    """The API server's address (the variables every pod gets)."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise KubeError("not in a Kubernetes pod (KUBERNETES_SERVICE_HOST unset)")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


class KubeApi:
    """One API server, one bearer token. `api`, `token_file`, `ca_file` default to the pod's own."""

    def __init__(self, api: str | None = None, token_file: Path | None = None, ca_file: Path | None = None,
                 timeout_s: float = 10.0):
        self.api = (api or api_server()).rstrip("/")
        token_file = token_file or SA_DIR / "token"
        try:
            self.token = token_file.read_text().strip()
        except OSError as err:
            raise KubeError(f"no service-account token ({err}): is automountServiceAccountToken off?") from None
        ca = ca_file if ca_file is not None else SA_DIR / "ca.crt"
        #: aiohttp's `ssl`: the cluster's CA for https; True (its default checks) otherwise.
        self.tls: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca)) if self.api.startswith("https") \
            else True
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def call(self, method: str, path: str, body: dict | None = None) -> Any:
        """`method path` with a JSON body; the decoded answer. A 404 is None for GET (absent)."""
        url = f"{self.api}{path}"
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            data = json.dumps(body)
        try:
            async with aiohttp.ClientSession(timeout=self.timeout) as http:
                async with http.request(method, url, data=data, headers=headers, ssl=self.tls) as resp:
                    if resp.status == 404 and method == "GET":
                        return None
                    if resp.status >= 300:
                        raise KubeError(f"{method} {url}: HTTP {resp.status}" + (
                            ": forbidden: the service account's RBAC lacks this verb" if resp.status == 403 else ""),
                            resp.status)
                    return await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            raise KubeError(f"{method} {url}: {type(err).__name__}: {err}") from None
