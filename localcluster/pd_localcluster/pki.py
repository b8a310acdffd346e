"""Certificates and keys for the local control plane: one CA, the API server's serving
cert, client certs per component, the node agent's serving cert, and the service-account
signing key."""
from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=365)
MAX_NODES = 32


def node_ip(index: int) -> str:
    """Each local node has its own loopback address; its pods get addresses under it."""
    return f"127.0.1.{index + 1}"


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


class PKI:
    """Creates (once) and reuses the files under ``directory``."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path:
        return self.dir / name

    def ensure(self) -> None:
        if not self.path("ca.crt").exists():
            self._write_ca()
        if not self.path("sa.key").exists():
            key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            self.path("sa.key").write_bytes(_pem_key(key))
            self.path("sa.pub").write_bytes(
                key.public_key().public_bytes(
                    serialization.Encoding.PEM,
                    serialization.PublicFormat.SubjectPublicKeyInfo,
                )
            )
        self._leaf(
            "apiserver",
            _name("kube-apiserver"),
            server=True,
            dns=["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                 "kubernetes.default.svc.cluster.local"],
            ips=["127.0.0.1", "10.96.0.1"],
        )
        self._leaf("admin", _name("kubernetes-admin", "system:masters"))
        self._leaf("controller-manager", _name("system:kube-controller-manager"))
        self._leaf("scheduler", _name("system:kube-scheduler"))
        self._leaf("apiserver-kubelet-client", _name("kube-apiserver-kubelet-client", "system:masters"))
        self._leaf("node-agent-serving", _name("local-node-agent"), server=True,
                   dns=["localhost"],
                   ips=["127.0.0.1"] + [node_ip(i) for i in range(MAX_NODES)])

    def _load_ca(self):
        cert = x509.load_pem_x509_certificate(self.path("ca.crt").read_bytes())
        key = serialization.load_pem_private_key(self.path("ca.key").read_bytes(), None)
        return cert, key

    def _write_ca(self) -> None:
        key = _key()
        now = dt.datetime.now(dt.timezone.utc)
        name = _name("pd-operator-local-ca")
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY * 10)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True,
                    content_commitment=False, key_encipherment=False, data_encipherment=False,
                    key_agreement=False, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        self.path("ca.key").write_bytes(_pem_key(key))
        self.path("ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def _leaf(self, stem: str, subject: x509.Name, *, server: bool = False,
              dns: list[str] | None = None, ips: list[str] | None = None) -> None:
        if self.path(f"{stem}.crt").exists():
            return
        ca_cert, ca_key = self._load_ca()
        key = _key()
        now = dt.datetime.now(dt.timezone.utc)
        usage = [ExtendedKeyUsageOID.SERVER_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        )
        if dns or ips:
            sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns or []]
            sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips or []]
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        self.path(f"{stem}.key").write_bytes(_pem_key(key))
        self.path(f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
