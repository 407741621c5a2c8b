"""TLS, mutual TLS, token auth together, and per-client stream limits, on a real `packfeed serve`."""

from __future__ import annotations

import datetime
import ipaddress

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from packfeed.client import Connection, LocalServer, PackfeedError, PackStream

pytestmark = pytest.mark.slow
PLAN = {"dp": 1, "microbatches": 1}


def issue(name: str, issuer=None, issuer_key=None, ca: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer or subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    certificate = builder.sign(issuer_key or key, hashes.SHA256())
    return key, certificate


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    root = tmp_path_factory.mktemp("pki")
    ca_key, ca = issue("packfeed test CA", ca=True)
    files = {}
    for name, (key, cert) in {"ca": (ca_key, ca), "server": issue("server", ca.subject, ca_key),
                              "client": issue("trainer", ca.subject, ca_key)}.items():
        (root / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (root / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                             serialization.PrivateFormat.PKCS8,
                                                             serialization.NoEncryption()))
        files[name] = (str(root / f"{name}.pem"), str(root / f"{name}.key"))
    return files


def first_step_keys(target, **kwargs):
    with PackStream(target, job="secure", rank=0, retries=0, timeout=10, **PLAN, **kwargs) as stream:
        return next(iter(stream)).sample_keys


def test_tls_with_client_certificates_and_a_token(dataset, pki):
    env = {"PACKFEED_TLS_CERT": pki["server"][0], "PACKFEED_TLS_KEY": pki["server"][1],
           "PACKFEED_TLS_CLIENT_CA": pki["ca"][0], "PACKFEED_AUTH_TOKEN": "t0ken"}
    with LocalServer(dataset, workers=1, env=env) as server:
        client_cert = {"tls_cert": pki["client"][0], "tls_key": pki["client"][1]}
        assert first_step_keys(server.target, tls_ca=pki["ca"][0], token="t0ken", **client_cert)
        with pytest.raises(PackfeedError, match="UNAUTHENTICATED: no token was sent.*PACKFEED_AUTH_TOKEN"):
            first_step_keys(server.target, tls_ca=pki["ca"][0], token="", **client_cert)  # TLS is no substitute
        with pytest.raises(PackfeedError, match="UNAUTHENTICATED: the token sent is not this server's"):
            first_step_keys(server.target, tls_ca=pki["ca"][0], token="other", **client_cert)
        assert "t0ken" not in repr(Connection(token="t0ken"))  # a repr lands in logs and tracebacks
        with pytest.raises(PackfeedError, match="UNAVAILABLE"):  # no client certificate: handshake refused
            first_step_keys(server.target, tls_ca=pki["ca"][0], token="t0ken")
        with pytest.raises(PackfeedError, match="UNAVAILABLE"):  # plaintext against a TLS server
            first_step_keys(server.target, token="t0ken")


def test_a_client_cannot_open_more_streams_than_its_limit(dataset):
    with LocalServer(dataset, workers=1, env={"PACKFEED_MAX_STREAMS_PER_CLIENT": "1"}) as server:
        first = PackStream(server.target, job="limited", rank=0, dp=2, microbatches=1, prefetch=1)
        steps = iter(first)
        next(steps)  # rank 0's stream is open (the server holds it while prefetching)
        channel = grpc.insecure_channel(server.target)
        from packfeed.v1 import packfeed_pb2 as pb
        from packfeed.v1 import packfeed_pb2_grpc as pb_grpc

        second = pb_grpc.PackfeedStub(channel).StreamPacks(pb.StreamPacksRequest(job="limited", rank=1))
        with pytest.raises(grpc.RpcError) as refused:
            next(second)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_streams_per_client" in refused.value.details()
        first.close()
        channel.close()
