{{/* The release's prefix for every object: "<release>" when it already says turnstream, else "<release>-turnstream". */}}
{{- define "ts.fullname" -}}
{{- if contains "turnstream" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-turnstream" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ts.labels" -}}
app.kubernetes.io/name: turnstream
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: include "ts.selector" (list . "proxy") */}}
{{- define "ts.selector" -}}
app.kubernetes.io/name: turnstream
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* A container's image, and what every container here has (Kubernetes' `restricted` Pod Security profile): no
privilege escalation, no capabilities; a read-only root file system where the image writes nothing outside its
volumes (image.*.readOnlyRootFilesystem). include "ts.image" (list .Values.image.turnstream) */}}
{{- define "ts.image" -}}
{{- $i := index . 0 -}}
image: {{ printf "%s:%s" $i.repository (toString $i.tag) | quote }}
imagePullPolicy: {{ $i.pullPolicy }}
securityContext:
  allowPrivilegeEscalation: false
  capabilities: {drop: [ALL]}
  readOnlyRootFilesystem: {{ $i.readOnlyRootFilesystem | default false }}
{{- end -}}

{{- define "ts.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-keys" (include "ts.fullname" .)) -}}
{{- end -}}

{{/* The Secret whose "keys" is the proxy's per-user keys file (scripts/k8s/keys.sh changes it). */}}
{{- define "ts.proxyKeysSecret" -}}
{{- .Values.proxy.keys.existingSecret | default (printf "%s-proxy-keys" (include "ts.fullname" .)) -}}
{{- end -}}

{{/* Bundled Kafka's brokers by their stable names (StatefulSet pods behind a headless Service), or yours. */}}
{{- define "ts.kafkaBootstrap" -}}
{{- if .Values.kafka.bundled -}}
{{- $fn := include "ts.fullname" . -}}
{{- $hosts := list -}}
{{- range $i := until (int .Values.kafka.brokers) -}}
{{- $hosts = append $hosts (printf "%s-kafka-%d.%s-kafka:9092" $fn $i $fn) -}}
{{- end -}}
{{- join "," $hosts -}}
{{- else -}}
{{- required "kafka.bootstrap: the brokers of your Kafka cluster (kafka.bundled is false)" .Values.kafka.bootstrap -}}
{{- end -}}
{{- end -}}

{{/* The Secret with a password per Kafka user (runtime/security/kafka_users.py's NAMES, and `controller`). */}}
{{- define "ts.kafkaUsersSecret" -}}
{{- .Values.kafka.users.existingSecret | default (printf "%s-kafka-users" (include "ts.fullname" .)) -}}
{{- end -}}

{{/* Kafka for a service: bundled, its own SCRAM user (include "ts.kafkaEnv" (list . "proxy"); "topics" is the
operator, admin), whose ACLs `turnstream kafka-users apply` made in the topics job. kafka.bundled false: yours,
through `env` (docs/security.md). */}}
{{- define "ts.kafkaEnv" -}}
{{- $root := index . 0 -}}
{{- $user := index . 1 -}}
{{- if $root.Values.kafka.bundled }}
{{- if eq $user "topics" }}{{ $user = "admin" }}{{ end }}
- name: TURNSTREAM_KAFKA_SECURITY_PROTOCOL
  value: SASL_PLAINTEXT
- name: TURNSTREAM_KAFKA_SASL_MECHANISM
  value: SCRAM-SHA-512
- name: TURNSTREAM_KAFKA_SASL_USERNAME
  value: {{ $user | quote }}
- name: TURNSTREAM_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "ts.kafkaUsersSecret" $root }}
      key: {{ $user }}
{{- end }}
{{- end -}}

{{/* The Secret with a password per Redis ACL user (runtime/security/redis_users.py's NAMES). */}}
{{- define "ts.redisUsersSecret" -}}
{{- .Values.redis.users.existingSecret | default (printf "%s-redis-users" (include "ts.fullname" .)) -}}
{{- end -}}

{{- define "ts.redisSecretEnv" -}}
- name: {{ index . 1 }}
  valueFrom:
    secretKeyRef:
      name: {{ include "ts.redisUsersSecret" (index . 0) }}
      key: {{ index . 2 }}
{{- end -}}

{{/* Redis for a service: bundled, the service's own ACL user (include "ts.redisEnv" (list . "proxy")), through the
three Sentinels (group "turnstream", asked as `client`) or the one server; user "" logs in as `probe` (PING only,
no password: what an init container's wait asks). redis.bundled false: redis.url, yours. */}}
{{- define "ts.redisEnv" -}}
{{- $root := index . 0 -}}
{{- $user := index . 1 -}}
{{- $fn := include "ts.fullname" $root -}}
{{- if not $root.Values.redis.bundled }}
- name: TURNSTREAM_REDIS_URL
  value: {{ required "redis.url: redis://… or redis+sentinel://… of your Redis (redis.bundled is false)" $root.Values.redis.url | quote }}
{{- else }}
{{- $login := "probe:probe@" }}
{{- if $user }}
{{ include "ts.redisSecretEnv" (list $root "REDIS_PASSWORD" $user) }}
{{- $login = printf "%s:$(REDIS_PASSWORD)@" $user }}
{{- end }}
{{- if $root.Values.redis.sentinel }}
{{ include "ts.redisSecretEnv" (list $root "REDIS_PASSWORD_CLIENT" "client") }}
{{- $hosts := list }}
{{- range $i := until 3 }}
{{- $hosts = append $hosts (printf "%s-redis-sentinel-%d.%s-redis-sentinel:26379" $fn $i $fn) }}
{{- end }}
- name: TURNSTREAM_REDIS_URL
  value: {{ printf "redis+sentinel://%s%s/turnstream/0?sentinel_username=client&sentinel_password=$(REDIS_PASSWORD_CLIENT)" $login (join "," $hosts) | quote }}
{{- else }}
- name: TURNSTREAM_REDIS_URL
  value: {{ printf "redis://%s%s-redis-0.%s-redis:6379/0" $login $fn $fn | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Every policy replica by its stable name: the proxy routes sessions between them. */}}
{{- define "ts.policyUrls" -}}
{{- $fn := include "ts.fullname" . -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.policy.replicas) -}}
{{- $urls = append $urls (printf "http://%s-policy-%d.%s-policy:30000" $fn $i $fn) -}}
{{- end -}}
{{- join "," $urls -}}
{{- end -}}

{{/* The judge's and the teacher's server: its own, or (teacherServer.enabled false) the policy servers. */}}
{{- define "ts.teacherUrl" -}}
{{- if .Values.teacherServer.enabled -}}
{{- printf "http://%s-teacher-server:30002" (include "ts.fullname" .) -}}
{{- else -}}
{{- printf "http://%s-policy:30000" (include "ts.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "ts.secretEnv" -}}
- name: {{ index . 1 }}
  valueFrom:
    secretKeyRef:
      name: {{ include "ts.secretName" (index . 0) }}
      key: {{ index . 2 }}
{{- end -}}

{{/* What every turnstream service is given (compose.yaml's x-turnstream environment), Redis as its own user:
include "ts.commonEnv" (list . "pairer"). */}}
{{- define "ts.commonEnv" -}}
{{- $user := index . 1 -}}
{{- $kafkaUser := $user -}}
{{- if gt (len .) 2 }}{{ $kafkaUser = index . 2 }}{{ end -}}
{{- with index . 0 -}}
- name: TURNSTREAM_KAFKA_BOOTSTRAP
  value: {{ include "ts.kafkaBootstrap" . | quote }}
- name: TURNSTREAM_KAFKA_NAMESPACE
  value: {{ .Values.kafkaNamespace | quote }}
{{- include "ts.kafkaEnv" (list . $kafkaUser) }}
{{- include "ts.redisEnv" (list . $user) }}
{{- if and .Values.redis.bundled .Values.redis.sentinel }}
- name: TURNSTREAM_KAFKA_SEAL_KEYS_REPLICAS # a new sealing key reaches the replica before anything is sealed
  value: "1"
{{- end }}
- name: HOME # the root file system is read-only: caches go to the pod's /tmp (ts.tmpVolume)
  value: /tmp
- name: TURNSTREAM_CACHE
  value: /tmp/turnstream
- name: TURNSTREAM_METRICS_PORT
  value: "9100"
- name: TURNSTREAM_METRICS_HOST
  value: 0.0.0.0
- name: TURNSTREAM_LOGGING_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: TURNSTREAM_DISPATCHER_MODE
  value: {{ .Values.mode | quote }}
- name: TURNSTREAM_GATE_ENABLED
  value: {{ .Values.gate.enabled | quote }}
- name: TURNSTREAM_GATE_MECHANISM
  value: {{ .Values.gate.mechanism | quote }}
- name: TURNSTREAM_GATE_MARGIN
  value: {{ .Values.gate.margin | quote }}
- name: TURNSTREAM_GATE_RESTORE_AFTER
  value: {{ .Values.gate.restoreAfter | quote }}
- name: TURNSTREAM_GATE_CANDIDATE_SHARE
  value: {{ .Values.gate.candidateShare | quote }}
{{- if .Values.lora.enabled }}
- name: TURNSTREAM_TRAINER_LORA_ENABLED
  value: "true"
- name: TURNSTREAM_TRAINER_LORA_RANK
  value: {{ .Values.lora.rank | quote }}
{{- end }}
- name: OMP_NUM_THREADS
  value: {{ .Values.ompThreads | quote }}
{{- range $k, $v := .Values.env }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A service's own env map, after the common one (later entries win). */}}
{{- define "ts.ownEnv" -}}
{{- range $k, $v := . }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- end -}}

{{- define "ts.modelsVolume" -}}
- name: models
{{- if .Values.models.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.models.existingClaim }}
    readOnly: true
{{- else }}
  hostPath:
    path: {{ .Values.models.hostPath }}
    type: Directory
{{- end }}
{{- end -}}

{{- define "ts.weightsVolume" -}}
- name: weights
  persistentVolumeClaim:
    claimName: {{ .Values.weights.existingClaim | default (printf "%s-weights" (include "ts.fullname" .)) }}
{{- end -}}

{{/* The probe compose.yaml's services have: their /metrics answers. */}}
{{- define "ts.metricsProbes" -}}
readinessProbe:
  httpGet: {path: /metrics, port: metrics}
  periodSeconds: 15
  timeoutSeconds: 5
livenessProbe:
  httpGet: {path: /metrics, port: metrics}
  initialDelaySeconds: 60
  periodSeconds: 15
  timeoutSeconds: 5
  failureThreshold: 5
{{- end -}}

{{/* Services wait for their topics and Redis: an init container that asks until both answer (compose's
depends_on), as the service's Kafka user (which may describe every topic) and Redis's `probe`. The turnstream image
has Python: no other image is pulled for it. include "ts.waitForInfra" (list . "proxy") */}}
{{- define "ts.waitForInfra" -}}
{{- $root := index . 0 -}}
- name: wait-for-kafka-and-redis
  {{- include "ts.image" (list $root.Values.image.turnstream) | nindent 2 }}
  command: ["python", "-m", "services.cli", "topics", "wait"]
  env:
    {{- include "ts.commonEnv" (list $root "" (index . 1)) | nindent 4 }}
{{- end -}}

{{/* A pod as Kubernetes' `restricted` Pod Security profile asks: its image's non-root user (image.*.uid, or
``runAsUser`` given), that user's group owning its volumes (fsGroup: a folder the service makes private, chmod 700,
is a subfolder it creates and so owns), the runtime's default seccomp profile, and no service-account token (no
pod here talks to the API server). include "ts.podSecurity" (list .Values.image.turnstream) or (list image uid) */}}
{{- define "ts.podSecurity" -}}
{{- $uid := (index . 0).uid -}}
{{- if gt (len .) 1 }}{{ with index . 1 }}{{ $uid = . }}{{ end }}{{ end -}}
automountServiceAccountToken: false
securityContext:
  runAsNonRoot: {{ ne (int $uid) 0 }}
  runAsUser: {{ $uid }}
  runAsGroup: {{ $uid }}
  fsGroup: {{ $uid }}
  seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{/* Where a container with a read-only root file system writes what is its own and passing (Python's and the
libraries' caches, a generated config): an emptyDir at /tmp, and HOME there. */}}
{{- define "ts.tmpMount" -}}
- {name: tmp, mountPath: /tmp}
{{- end -}}
{{- define "ts.tmpVolume" -}}
- {name: tmp, emptyDir: {}}
{{- end -}}

{{/* Writes Redis's ACL file and the Sentinels' user lines (turnstream redis-users: hashes only) into the pod's
"acl" emptyDir, from the passwords Secret: the one place the users are declared is turnstream's code. */}}
{{- define "ts.redisUsersInit" -}}
- name: redis-users
  {{- include "ts.image" (list .Values.image.turnstream) | nindent 2 }}
  command: ["python", "-m", "services.cli", "redis-users", "--out", "/acl/users.acl", "--sentinel-out", "/acl/sentinel-users.conf"]
  env:
    {{- range $user := list "admin" "replica" "sentinel" "client" "proxy" "pairer" "dispatcher" "judge" "teacher" "trainer" "gate" "topics" "simulate" "eval" "console" }}
    {{- include "ts.redisSecretEnv" (list $ (printf "REDIS_PASSWORD_%s" (upper $user)) $user) | nindent 4 }}
    {{- end }}
    {{- range $k, $v := .Values.env }}
    - name: {{ $k }}
      value: {{ $v | quote }}
    {{- end }}
  volumeMounts:
    - {name: acl, mountPath: /acl}
{{- end -}}
