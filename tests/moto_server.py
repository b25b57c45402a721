"""moto's server with DynamoDB requests served one at a time.

Used by the tests and benchmarks instead of `moto_server` (same arguments). moto serves each
request on a thread of its own, and its TransactWriteItems is not isolated: it applies the
actions one by one and, when one fails its condition, puts back a copy of the whole table taken
before it started, which also takes back whatever another request committed in between
(appends, claims and completions reported as done). DynamoDB serializes transactions; holding a
lock around each DynamoDB request gives the tests that guarantee. Other services (SQS long polls)
stay concurrent.
"""

import threading

from moto import server
from moto.moto_server import werkzeug_app


class SerialDynamoDb:
    """WSGI middleware: one DynamoDB request at a time (the X-Amz-Target of its JSON protocol)."""

    def __init__(self, app):
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ, start_response):
        if environ.get("HTTP_X_AMZ_TARGET", "").startswith("DynamoDB_"):
            with self.lock:
                # The whole answer, so that no part of the request runs outside the lock.
                return list(self.app(environ, start_response))
        return self.app(environ, start_response)


def serial_app(*args, **kwargs):
    return SerialDynamoDb(werkzeug_app.DomainDispatcherApplication(*args, **kwargs))


if __name__ == "__main__":
    server.DomainDispatcherApplication = serial_app
    server.main()
