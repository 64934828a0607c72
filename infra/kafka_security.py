"""A local broker with authentication, encryption and authorization: SASL/SCRAM-SHA-512 over TLS
(``SASL_SSL``), users created when the storage is formatted, and Kafka's StandardAuthorizer with
``allow.everyone.if.no.acl.found=false``, so a user can do only what an ACL grants it.

    sec = BrokerSecurity.create(data_dir, host, {"harness": "..."})  # CA, server cert, admin
    config = secure_config(BrokerConfig(...), sec)  # listener, extra, format arguments
    KafkaBroker(config).start()
    grant_harness(admin_settings, "harness")       # may produce to <ns>.rollout.events
    sec.client_settings("harness")                 # the ROLLSTREAM_KAFKA_* of a user

What each piece is:
- TLS: a CA and a server certificate (RSA 2048, SAN = the broker's IP and ``localhost``) made
  here with ``cryptography`` under ``<dir>/tls`` (key files mode 0600); the broker reads PEM
  files (``ssl.keystore.type=PEM``), clients verify the server against the CA
  (``ROLLSTREAM_KAFKA_SSL_CA_LOCATION``), hostname included.
- SASL/SCRAM-SHA-512: every user (``admin`` always, a super user) is added to the metadata log
  by ``kafka-storage format --add-scram``, so no plaintext door is needed to create them.
- The client listener is ``SASL_SSL``; the broker talks to itself over it as ``admin``. The
  KRaft controller listener stays PLAINTEXT on the broker's own address: it serves only the
  controller quorum (no produce, fetch or admin requests), and its principal (ANONYMOUS) is a
  super user because the broker registers through it.
- ACLs (``harness_acls``): a harness credential may write to and describe ``<ns>.rollout.events``
  and nothing else: no other topic, no reads, no consumer groups, no admin operations.

The settings clients use are the existing ``ROLLSTREAM_KAFKA_SECURITY_PROTOCOL``,
``_SASL_MECHANISM``, ``_SASL_USERNAME``, ``_SASL_PASSWORD``, ``_SSL_CA_LOCATION``.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rollstream.infra.kafka import BrokerConfig
from rollstream.schemas import CommonSettings, Topics

__all__ = [
    "ADMIN_USER",
    "MECHANISM",
    "BrokerSecurity",
    "TlsFiles",
    "grant_harness",
    "harness_acls",
    "make_tls",
    "secure_config",
]

ADMIN_USER = "admin"
MECHANISM = "SCRAM-SHA-512"
LISTENER = "SASL_SSL"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    ca: Path  # the CA certificate (PEM): what clients trust
    chain: Path  # the server certificate, then the CA's (PEM)
    key: Path  # the server's private key (PKCS#8 PEM, mode 0600)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_tls(directory: Path, host: str, *, days: int = 30) -> TlsFiles:
    """A CA and a server certificate for ``host`` (an IP address or a name) under
    ``directory``; made once, reused when the files are there."""
    files = TlsFiles(directory / "ca.pem", directory / "server-chain.pem", directory / "server.key")
    if all(p.exists() for p in (files.ca, files.chain, files.key)):
        return files
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID
    except ImportError as exc:  # a dev/test dependency
        msg = f"TLS for the local broker needs `pip install cryptography` ({exc})"
        raise RuntimeError(msg) from exc
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rollstream local CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    try:
        names.append(x509.IPAddress(ipaddress.ip_address(host)))
    except ValueError:
        names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    files.ca.write_bytes(ca.public_bytes(pem))
    files.chain.write_bytes(cert.public_bytes(pem) + ca.public_bytes(pem))
    _write_private(
        files.key,
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    return files


@dataclass(frozen=True, slots=True)
class BrokerSecurity:
    """Users (name -> password; ``admin`` is always one of them, a super user) and the TLS
    files of one local broker."""

    tls: TlsFiles
    users: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, directory: Path, host: str, users: dict[str, str]) -> BrokerSecurity:
        all_users = {ADMIN_USER: secrets.token_urlsafe(24), **users}
        return cls(make_tls(directory / "tls", host), all_users)

    def client(self, user: str) -> dict[str, str]:
        """librdkafka settings of ``user`` (what kafka_client_config makes of its settings)."""
        return {
            "security.protocol": LISTENER,
            "sasl.mechanism": MECHANISM,
            "sasl.username": user,
            "sasl.password": self.users[user],
            "ssl.ca.location": str(self.tls.ca),
        }

    def client_settings(self, user: str) -> dict[str, Any]:
        """The CommonSettings fields (ROLLSTREAM_KAFKA_*) of ``user``."""
        return {
            "kafka_security_protocol": LISTENER,
            "kafka_sasl_mechanism": MECHANISM,
            "kafka_sasl_username": user,
            "kafka_sasl_password": self.users[user],
            "kafka_ssl_ca_location": str(self.tls.ca),
        }


def _jaas(user: str, password: str) -> str:
    return (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="{user}" password="{password}";'
    )


def secure_config(config: BrokerConfig, security: BrokerSecurity) -> BrokerConfig:
    """``config`` with a SASL_SSL client listener, SCRAM users added at format time, TLS from
    PEM files and the StandardAuthorizer (deny unless an ACL allows; ``admin`` a super user)."""
    for name, password in security.users.items():
        if not name.replace("-", "").replace("_", "").isalnum() or '"' in password:
            raise ValueError(f"user {name!r}: names are [A-Za-z0-9_-], passwords without quotes")
    listener = LISTENER.lower()
    extra = {
        **config.extra,
        "sasl.enabled.mechanisms": MECHANISM,
        "sasl.mechanism.inter.broker.protocol": MECHANISM,
        f"listener.name.{listener}.{MECHANISM.lower()}.sasl.jaas.config": _jaas(
            ADMIN_USER, security.users[ADMIN_USER]
        ),
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(_keystore(security.tls)),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(security.tls.ca),
        "ssl.endpoint.identification.algorithm": "",  # the broker to itself, by IP
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "false",
        "super.users": f"User:{ADMIN_USER};User:ANONYMOUS",  # ANONYMOUS: the controller listener
    }
    scram = [
        arg
        for name, password in security.users.items()
        for arg in ("--add-scram", f"{MECHANISM}=[name={name},password={password}]")
    ]
    return replace(
        config,
        listener=LISTENER,
        extra=extra,
        format_args=(*config.format_args, *scram),
        client=security.client(ADMIN_USER),
    )


def _keystore(tls: TlsFiles) -> Path:
    """One PEM file with the private key, then the certificate chain (Kafka's PEM keystore)."""
    path = tls.key.with_name("server-keystore.pem")
    if not path.exists():
        _write_private(path, tls.key.read_bytes() + tls.chain.read_bytes())
    return path


def harness_acls(namespace: str, user: str) -> list[Any]:
    """What a harness credential may do: write to and describe ``<ns>.rollout.events``."""
    from confluent_kafka.admin import (
        AclBinding,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    topic, principal, literal = (
        Topics(namespace).events,
        f"User:{user}",
        ResourcePatternType.LITERAL,
    )
    return [
        AclBinding(ResourceType.TOPIC, topic, literal, principal, "*", op, AclPermissionType.ALLOW)
        for op in (AclOperation.WRITE, AclOperation.DESCRIBE)
    ]


def grant_harness(admin_settings: CommonSettings, user: str, timeout: float = 30.0) -> None:
    """Create the harness ACLs of ``user`` on ``admin_settings.namespace`` (as the admin)."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(admin_settings.kafka_config())
    futures = admin.create_acls(harness_acls(admin_settings.namespace, user))
    for future in futures.values():
        future.result(timeout)
