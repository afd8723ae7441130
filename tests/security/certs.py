"""Test certificates made at test time with ``cryptography``: a CA, a server cert for 127.0.0.1/localhost, a client cert."""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

import attrs


@attrs.frozen
class TestPKI:
    """Paths of PEM files: ``ca``, ``server_cert``/``server_key``, ``client_cert``/``client_key``, ``other_ca``."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str


def make_pki(directory: Path) -> TestPKI:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(path: Path, data: bytes) -> str:
        path.write_bytes(data)
        os.chmod(path, 0o600)
        return str(path)

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def ca(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(name(cn)).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        return cert, key

    def leaf(cn: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], usage: x509.ObjectIdentifier,
             sans: list[x509.GeneralName]) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(issuer[0].subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer[1].public_key()),
                                  critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(issuer[1], hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), key_pem(key)

    root = ca("genie test CA")
    other = ca("some other CA")
    server_pem, server_key = leaf("genie test server", root, ExtendedKeyUsageOID.SERVER_AUTH,
                                  [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client_pem, client_key = leaf("genie test client", root, ExtendedKeyUsageOID.CLIENT_AUTH, [])
    from cryptography.hazmat.primitives import serialization as ser

    return TestPKI(
        ca=write(directory / "ca.pem", root[0].public_bytes(ser.Encoding.PEM)),
        server_cert=write(directory / "server.pem", server_pem),
        server_key=write(directory / "server.key", server_key),
        client_cert=write(directory / "client.pem", client_pem),
        client_key=write(directory / "client.key", client_key),
        other_ca=write(directory / "other-ca.pem", other[0].public_bytes(ser.Encoding.PEM)),
    )
