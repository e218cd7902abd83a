#!/usr/bin/env python3
"""A stand-in CNI IPAM plugin for tests/test_cni.py, doing what its network
config's "ipam" section says:

    "ipam": {"type": "fake-ipam", "log": "<file>",
             "ADD": {"result": {"ips": [...], "routes": [...]}},   # ADD's answer
             "DEL": {"code": 42, "msg": "why"}}                    # fail with this CNI error

Every call but VERSION appends "<command> <CNI_CONTAINERID>" to the log, so
a test sees what the plugin under test asked for (an undo's DEL, say).
A command with no entry succeeds with no output (ADD: no addresses)."""

import json
import os
import sys

conf = json.load(sys.stdin)
command = os.environ["CNI_COMMAND"]
if command == "VERSION":
    print(json.dumps({"cniVersion": conf.get("cniVersion", "1.1.0"),
                      "supportedVersions": ["0.3.1", "0.4.0", "1.0.0", "1.1.0"]}))
    sys.exit(0)
ipam = conf["ipam"]
with open(ipam["log"], "a") as f:
    f.write(f"{command} {os.environ.get('CNI_CONTAINERID', '')}\n")
act = ipam.get(command, {})
if "code" in act:
    print(json.dumps({"cniVersion": conf["cniVersion"], "code": act["code"], "msg": act["msg"],
                      "details": "from fake-ipam"}))
    sys.exit(1)
if command == "ADD":
    print(json.dumps({"cniVersion": conf["cniVersion"], **act.get("result", {})}))
