"""moto's DynamoDB server, serving one request at a time (test harness only).

Run as ``python tests/moto_serialized.py HOST PORT``. Stock ``moto_server`` serves
requests on several threads without a lock and cancels a transaction by restoring a
deep copy of each table taken when it began (one copy per item): that loses writes
other threads committed meanwhile (acknowledged puts vanish and first-writer-wins
tests fail) and costs O(items x table size). This launcher serialises requests and
rolls a cancelled transaction back item by item. Real DynamoDB needs none of this.
"""
# ruff: noqa
# mypy: ignore-errors

import copy, sys, threading

import moto.dynamodb.models as ddb_models
from moto.dynamodb.models import DynamoDBBackend
from moto.dynamodb.models.dynamo_type import DynamoType
from moto.dynamodb.models.table import Table
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import run_simple

_transact = DynamoDBBackend.transact_write_items


class _NoTableSnapshot:
    # stands in for the copy module inside moto's transact_write_items, which
    # deep-copies every table it touches once per item, to restore it on failure
    @staticmethod
    def deepcopy(value, memo=None):
        return value if isinstance(value, Table) else copy.deepcopy(value, memo)


def _touched(backend, transact_items):
    touched = []
    for entry in transact_items:
        for op_type, op in entry.items():
            table = backend.get_table(op["TableName"])
            attrs = op["Item"] if op_type == "Put" else op["Key"]
            hash_value = DynamoType(attrs[table.hash_key_attr])
            range_attr = table.range_key_attr
            range_value = DynamoType(attrs[range_attr]) if range_attr else None
            old = table.get_item(hash_value, range_value)
            touched.append((table, hash_value, range_value, copy.deepcopy(old)))
    return touched


def transact_write_items(self, transact_items):
    try:
        touched = _touched(self, transact_items)
    except Exception:
        return _transact(self, transact_items)  # moto reports the malformed request
    ddb_models.copy = _NoTableSnapshot
    try:
        return _transact(self, transact_items)
    except BaseException:
        for table, hash_value, range_value, old in reversed(touched):
            if old is None:
                table.delete_item(hash_value, range_value)
            elif range_value is not None:
                table.items[hash_value][range_value] = old
            else:
                table.items[hash_value] = old
        raise
    finally:
        ddb_models.copy = copy


DynamoDBBackend.transact_write_items = transact_write_items
app = DomainDispatcherApplication(create_backend_app)
lock = threading.Lock()


def serialized(environ, start_response):
    with lock:
        return list(app(environ, start_response))


run_simple(
    sys.argv[1], int(sys.argv[2]), serialized, threaded=True, request_handler=MotoRequestHandler
)
