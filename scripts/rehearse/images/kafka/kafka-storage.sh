#!/usr/bin/env bash
exec java -Xmx256m -cp '/opt/kafka/libs/*' -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties kafka.tools.StorageTool "$@"
