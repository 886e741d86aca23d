"""The S3 server the tests of shipping run against."""

from tests.helpers.s3_server import s3_server as s3_server
