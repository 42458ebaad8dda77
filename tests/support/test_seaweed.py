"""The test SeaweedFS itself: it must hold every bucket the suite creates.

Each bucket is a SeaweedFS collection with volumes of its own. With weed's defaults (7 volumes
per new collection, a volume cap sized by free disk) the suite ran out of volumes near its
50th bucket and the last tests got HTTP 500 InternalError on their first put.
"""

from __future__ import annotations

import json
import urllib.request

from tests.conftest import new_bucket_uri
from tests.seaweed import MASTER_URLS


def _topology(endpoint: str) -> dict:
    with urllib.request.urlopen(f"{MASTER_URLS[endpoint]}/dir/status", timeout=10) as resp:
        return json.load(resp)["Topology"]


def test_seaweedfs_has_room_for_thousands_of_buckets(seaweedfs_endpoint: str) -> None:
    import boto3

    uri = new_bucket_uri(seaweedfs_endpoint)
    bucket = uri.removeprefix("s3://").split("/")[0]
    client = boto3.client("s3", endpoint_url=seaweedfs_endpoint, region_name="us-east-1")
    try:
        client.put_object(Bucket=bucket, Key="repo/probe", Body=b"x")
    finally:
        client.close()
    topology = _topology(seaweedfs_endpoint)
    layouts = [lay for lay in topology["Layouts"] if lay["collection"] == bucket]
    assert len(layouts) == 1
    assert len(layouts[0]["writables"]) == 1  # one volume per new bucket, not weed's 7
    assert topology["Max"] >= 5000
    assert topology["Free"] >= 4000
