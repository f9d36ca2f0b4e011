"""The edge: the bounded HTTP protocol, the server and its worker processes, the body budget and the
offload executor. Everything a request meets before it is authenticated."""
