"""A loopback stand-in for the Hugging Face hub, for tests/test_hub_ids.py: the routes huggingface_hub's
own client calls for list_repo_files, snapshot_download and hf_hub_download of a model repo (repo info,
the recursive tree, HEAD and GET of /ORG/NAME/resolve/REV/FILE with X-Repo-Commit, ETag and
Content-Length), serving local files, so that huggingface_hub itself writes a real cache (HF_ENDPOINT)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # every repo's one commit, served as "main" too


class HubRepos:
    """repo id -> {file name in the repo: local file}."""

    def __init__(self, repos: dict[str, dict[str, Path]]) -> None:
        self.repos = {repo.lower(): (repo, files) for repo, files in repos.items()}

    def files(self, repo_id: str) -> dict[str, Path] | None:
        entry = self.repos.get(repo_id.lower())
        return None if entry is None else entry[1]


def _etag(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _handler(hub: HubRepos) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._answer(with_body=False)

        def do_GET(self) -> None:
            self._answer(with_body=True)

        def _answer(self, with_body: bool) -> None:
            parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
            if parts[:2] == ["api", "models"] and len(parts) >= 6:
                return self._api(f"{parts[2]}/{parts[3]}", parts[4], parts[5])
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._file(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), with_body)
            self._error(404, "RepoNotFound")

        def _api(self, repo_id: str, kind: str, revision: str) -> None:
            files = hub.files(repo_id)
            if files is None:
                return self._error(404, "RepoNotFound")
            if revision not in ("main", COMMIT):
                return self._error(404, "RevisionNotFound")
            if kind == "revision":
                body = {"id": repo_id, "sha": COMMIT, "siblings": [{"rfilename": name} for name in files]}
            else:  # tree
                body = [{"type": "file", "path": name, "size": path.stat().st_size, "oid": _etag(path)[:40]}
                        for name, path in files.items()]
            self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

        def _file(self, repo_id: str, revision: str, name: str, with_body: bool) -> None:
            files = hub.files(repo_id)
            if files is None:
                return self._error(404, "RepoNotFound")
            if name not in files:
                return self._error(404, "EntryNotFound")
            data = files[name].read_bytes()
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_etag(files[name])}"'}
            self._send(200, data if with_body else b"", headers, len(data))

        def _error(self, status: int, code: str) -> None:
            self._send(status, json.dumps({"error": code}).encode(), {"X-Error-Code": code})

        def _send(self, status: int, body: bytes, headers: dict[str, str], length: int | None = None) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body) if length is None else length))
            self.end_headers()
            self.wfile.write(body)

    return Handler


@contextlib.contextmanager
def serving_hub(repos: dict[str, dict[str, Path]]):
    """The stand-in on a free loopback port until the block ends; yields its URL (for HF_ENDPOINT)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(HubRepos(repos)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
