"""A real Azure Blob Storage protocol server for tests: Azurite (Microsoft's emulator, from npm) in its own process
on 127.0.0.1, its packages installed from tests/azurite's lock file on first use."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from redis_server import free_port
from s3_server import start_process, stop_process

FOLDER = Path(__file__).parent / "azurite"
# Azurite's well-known development account (public, in Microsoft's documentation)
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def install() -> str | None:
    """Azurite's packages (npm ci); None when ready, else why they cannot be."""
    if not shutil.which("node") or not shutil.which("npm"):
        return "node and npm are needed for Azurite (apt-get install nodejs npm)"
    if not (FOLDER / "node_modules" / ".bin" / "azurite-blob").exists():
        done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=FOLDER,
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return f"npm could not install Azurite: {done.stderr[-500:]}"
    return None


class AzuriteServer:
    """azurite-blob on a free port, data in memory; `env` points adlfs (az://) at it."""

    def __init__(self):
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        return {"AZURE_STORAGE_CONNECTION_STRING": (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint=http://127.0.0.1:{self.port}/{ACCOUNT};")}

    def start(self) -> "AzuriteServer":
        binary = str(FOLDER / "node_modules" / ".bin" / "azurite-blob")
        self.process = start_process([binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
                                      "--inMemoryPersistence", "--disableTelemetry", "--silent",
                                      "--skipApiVersionCheck"], self.port)
        return self

    def stop(self) -> None:
        stop_process(self.process)
