"""The HTTP and gRPC edge: the servers we start (uvicorn, grpc.aio) with KServe's routes, the
gateway every request passes (admission, deadlines, auth, request lines), gRPC's policy, how
errors are answered in each route's shape, and the model repository the routes read."""
