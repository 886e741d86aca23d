"""The S3 server the tests of a lake on object storage run against."""

from tests.helpers.s3_server import s3_server as s3_server
