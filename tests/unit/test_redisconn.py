"""remp.redisconn: the redis+sentinel:// location (what the controller and policy accept)."""

import pytest

from remp.redisconn import is_sentinel_url, parse_sentinel_url
from remp.redisproc import redact_url


def test_sentinel_location_parses():
    loc = parse_sentinel_url("redis+sentinel://:p%40ss@127.0.0.1:26379,h2:26380/remp/2")
    assert loc.sentinels == (("127.0.0.1", 26379), ("h2", 26380))
    assert (loc.service, loc.db, loc.password) == ("remp", 2, "p@ss")
    assert "p@ss" not in repr(loc)
    assert parse_sentinel_url("redis+sentinel://h:1").service == "remp"
    assert is_sentinel_url("REDIS+SENTINEL://h:1") and not is_sentinel_url("redis://h:1/0")


@pytest.mark.parametrize("url", [
    "redis://h:1/0", "redis+sentinel://:secretpw@h/remp", "redis+sentinel://:secretpw@h:0/remp",
    "redis+sentinel://:secretpw@h:99999/remp", "redis+sentinel://:secretpw@h:1/bad name",
    "redis+sentinel://:secretpw@h:1/remp/x", "redis+sentinel://:secretpw@h:1/remp/0/more",
    "redis+sentinel://:secretpw@" + ",".join(f"h:{i}" for i in range(1, 20)) + "/remp",
    "redis+sentinel://:secretpw@h:1/" + "s" * 65,
])
def test_bad_locations_are_refused_without_echoing_the_password(url):
    with pytest.raises(ValueError) as e:
        parse_sentinel_url(url)
    assert "secretpw" not in str(e.value)


def test_a_sentinel_location_is_redacted_like_any_redis_url():
    url = "redis+sentinel://:topsecret@127.0.0.1:1,127.0.0.1:2/remp"
    assert redact_url(url) == "redis+sentinel://:***@127.0.0.1:1,127.0.0.1:2/remp"
