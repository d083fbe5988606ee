"""A proxyless gRPC client for the tests: resolves an `xds:///` target through the
gRPC xDS bootstrap named by GRPC_XDS_BOOTSTRAP (written by the Weir agent) and calls
grpc.health.v1.Health/Check on it.

usage: grpc_xds_client.py <target> <calls>

Prints one line per call: `status <n>` (HealthCheckResponse.status: 1 SERVING,
2 NOT_SERVING) or `error <code> <details>`. Exits 0 when every call got an answer.
Messages are encoded by hand (an empty request; the response's field 1 varint), so
grpcio is the only dependency.
"""

import sys

import grpc


def status_of(response: bytes) -> int:
    # HealthCheckResponse { ServingStatus status = 1; }: tag 0x08, one-byte varint.
    if len(response) == 0:
        return 0  # UNKNOWN, the default, is not sent
    if len(response) >= 2 and response[0] == 0x08:
        return response[1]
    raise ValueError(f"unexpected HealthCheckResponse bytes {response.hex()}")


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 64
    target, calls = sys.argv[1], int(sys.argv[2])
    failed = 0
    with grpc.insecure_channel(target) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        for _ in range(calls):
            try:
                response = check(b"", timeout=15, wait_for_ready=True)
                print(f"status {status_of(response)}", flush=True)
            except grpc.RpcError as e:
                failed += 1
                print(f"error {e.code().name} {e.details()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
