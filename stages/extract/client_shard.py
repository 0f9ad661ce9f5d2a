"""One client process of vLLM extraction: speculators' data-generation client over one share of
the rows (its `world_size` / `rank` split), started by `stages.extract.vllm_backend` when
`extract.clients` is above 1; never by hand.

    python -m stages.extract.client_shard '<json: url, model, requests, out, rank, world, ...>'

It writes `{"failed": {sample: reason}}` to the JSON's `result` path and exits 0, or exits with
the client's own code (1: it gave up, e.g. the server stopped answering; 130: interrupted). Why
processes: one Python client sends about 100 requests a second at most, because the OpenAI client
library walks every prompt token id of a request in Python before sending it; several processes
multiply that, and speculators' client already knows how to take a share of the rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    a = json.loads(argv[0])
    from stages.extract.vllm_backend import ClientExit, client_pass

    try:
        failed = client_pass(
            a["url"],
            a["model"],
            Path(a["requests"]),
            Path(a["out"]),
            concurrency=a["concurrency"],
            request_timeout_s=a["request_timeout_s"],
            max_retries=a["max_retries"],
            world=a["world"],
            rank=a["rank"],
        )
    except ClientExit as exc:
        Path(a["result"]).write_text(json.dumps({"failed": exc.failed}))
        return exc.code
    Path(a["result"]).write_text(json.dumps({"failed": failed}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
