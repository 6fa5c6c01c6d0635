#!/usr/bin/python3
"""A gRPC server and client from grpcio (Debian's python3-grpcio), with no
generated code: the one method takes and returns raw bytes.

    grpc_peer.py serve                   prints its port, serves until stdin closes
    grpc_peer.py call ADDR KEY MESSAGE   one unary call through ADDR; prints
                                         "OK <reply> <trailer>" or "<CODE> <details>"
"""

import sys
from concurrent import futures

import grpc

# No proxy from the environment: the calls go to loopback only.
OPTIONS = [("grpc.enable_http_proxy", 0)]


def serve():
    def reverse(request, context):
        context.set_trailing_metadata((("echo-trailer", "kept"),))
        return request[::-1]

    handler = grpc.method_handlers_generic_handler(
        "echo.Echo", {"Reverse": grpc.unary_unary_rpc_method_handler(reverse)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()
    server.stop(0)


def call(addr, key, message):
    with grpc.insecure_channel(addr, options=OPTIONS) as channel:
        method = channel.unary_unary("/echo.Echo/Reverse")
        try:
            reply, outcome = method.with_call(
                message.encode(), metadata=(("authorization", f"Bearer {key}"),), timeout=10)
        except grpc.RpcError as e:
            print(f"{e.code().name} {e.details()}")
            return
        trailer = dict(outcome.trailing_metadata()).get("echo-trailer", "-")
        print(f"OK {reply.decode()} {trailer}")


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve()
    else:
        call(*sys.argv[2:5])
