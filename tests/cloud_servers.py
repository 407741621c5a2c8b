"""Real cloud object-store servers for tests, each its own process on 127.0.0.1: Azurite (Microsoft's Azure Blob
Storage emulator, from npm, installed from tests/azurite's lock file on first use) and gcp-storage-emulator (a
Google Cloud Storage JSON API server, from PyPI). Each gives the environment that points Packfeed's fsspec
backends (adlfs for az://, gcsfs for gs://) at it, and a filesystem to put, overwrite and delete objects."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from ports import free_port
from s3_server import start_process, stop_process

AZURITE = Path(__file__).parent / "azurite"
# Azurite's well-known development account (public, in Microsoft's documentation)
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def install_azurite() -> str | None:
    """Azurite's packages (npm ci); None when ready, else why they cannot be."""
    if not shutil.which("node") or not shutil.which("npm"):
        return "node and npm are needed for Azurite (apt-get install nodejs npm)"
    if not (AZURITE / "node_modules" / ".bin" / "azurite-blob").exists():
        done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=AZURITE,
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return f"npm could not install Azurite: {done.stderr[-500:]}"
    return None


class CloudServer:
    scheme: str

    def __init__(self):
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        raise NotImplementedError

    def command(self) -> list[str]:
        raise NotImplementedError

    def filesystem(self):
        raise NotImplementedError

    def start(self) -> "CloudServer":
        self.process = start_process(self.command(), self.port)
        return self

    def stop(self) -> None:
        stop_process(self.process)


class AzuriteServer(CloudServer):
    """azurite-blob, data in memory; az:// through adlfs."""

    scheme = "az"

    @property
    def env(self) -> dict[str, str]:
        return {"AZURE_STORAGE_CONNECTION_STRING": (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint=http://127.0.0.1:{self.port}/{ACCOUNT};")}

    def command(self) -> list[str]:
        return [str(AZURITE / "node_modules" / ".bin" / "azurite-blob"), "--blobHost", "127.0.0.1", "--blobPort",
                str(self.port), "--inMemoryPersistence", "--disableTelemetry", "--silent", "--skipApiVersionCheck"]

    def filesystem(self):
        import adlfs

        return adlfs.AzureBlobFileSystem(connection_string=self.env["AZURE_STORAGE_CONNECTION_STRING"],
                                         skip_instance_cache=True)


class GcsServer(CloudServer):
    """gcp-storage-emulator, data in memory; gs:// through gcsfs. gcsfs (2026.3 and later) first asks a bucket's
    type of the Storage Control API over gRPC, which no emulator answers (each ask waits 60 s): its own switch,
    GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false, turns that off, read when gcsfs is imported."""

    scheme = "gs"

    @property
    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{self.port}", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                "NO_GCE_CHECK": "true", "GOOGLE_CLOUD_PROJECT": "packfeed-test"}

    def command(self) -> list[str]:
        return [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port",
                str(self.port), "--in-memory"]

    def filesystem(self):
        import gcsfs

        return gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True)
