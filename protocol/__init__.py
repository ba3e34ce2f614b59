"""gRPC contracts (``*.proto``), their generated modules, and the tensor codec.

Generated ``*_pb2.py`` / ``*_pb2_grpc.py`` are build outputs, not sources: they are
(re)built from the ``.proto`` files with the pinned grpcio-tools the first time
``protocol`` is imported after a ``.proto`` changed (or explicitly with
``python -m protocol.build``). The Docker builder runs the explicit step so the wheel
ships them and a read-only install never needs to write.
"""

from protocol.build import ensure_generated

ensure_generated()
