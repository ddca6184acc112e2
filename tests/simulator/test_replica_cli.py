"""`kvgate replica` as a process: prints its URL, serves (a CPU tier sized by vLLM's
`--kv-offloading-size`), and exits 0 on SIGTERM."""

import re
import signal
import subprocess
import sys

import aiohttp


async def test_replica_process_serves_and_stops_cleanly():
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvgate.cli",
            "replica",
            "--port",
            "0",
            "--time-scale",
            "0",
            "--num-blocks",
            "128",
            "--scheduling-policy",
            "priority",
            "--kv-offloading-size",
            "0.5",
            "--kv-bytes-per-token",
            "65536",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        match = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        assert match, (
            f"no URL in the first line: {line!r} {process.stderr.read() if process.poll() is not None else ''}"
        )
        async with aiohttp.ClientSession() as session:
            response = await session.post(
                match.group(1) + "/v1/completions", json={"prompt": "hello world", "max_tokens": 3}
            )
            assert response.status == 200
            assert (await response.json())["usage"]["completion_tokens"] == 3
            kv = await (await session.get(match.group(1) + "/v1/kvgate/kv")).json()
            assert kv["num_total_blocks"] == 128 and kv["scheduling_policy"] == "priority"
            assert kv["num_cpu_blocks"] == 512  # 0.5 GiB of 16-token blocks at 64 KiB a token
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
        process.stderr.close()
