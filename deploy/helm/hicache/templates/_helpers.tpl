{{/* Names -------------------------------------------------------------------------------------- */}}
{{- define "hicache.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "hicache.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Component names stay <= 63 characters with their suffixes (pod names add more for StatefulSets). */}}
{{- define "hicache.node.name" -}}{{ include "hicache.fullname" . | trunc 50 | trimSuffix "-" }}-node{{- end }}
{{- define "hicache.node.headless" -}}{{ include "hicache.fullname" . | trunc 41 | trimSuffix "-" }}-node-headless{{- end }}
{{- define "hicache.router.name" -}}{{ include "hicache.fullname" . | trunc 48 | trimSuffix "-" }}-router{{- end }}
{{- define "hicache.redis.name" -}}{{ include "hicache.fullname" . | trunc 49 | trimSuffix "-" }}-redis{{- end }}
{{- define "hicache.redis.headless" -}}{{ include "hicache.fullname" . | trunc 40 | trimSuffix "-" }}-redis-headless{{- end }}
{{- define "hicache.config.name" -}}{{ include "hicache.fullname" . | trunc 48 | trimSuffix "-" }}-config{{- end }}
{{- define "hicache.secret.name" -}}{{ include "hicache.fullname" . | trunc 48 | trimSuffix "-" }}-secret{{- end }}

{{- define "hicache.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "hicache.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Labels ------------------------------------------------------------------------------------- */}}
{{- define "hicache.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "hicache.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "node") */}}
{{- define "hicache.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hicache.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Image ---------------------------------------------------------------------------------------- */}}
{{/* (dict "ctx" $ "gpu" BOOL): "<appVersion>-cuda" for GPU pods, "<appVersion>" (CPU image) otherwise. */}}
{{- define "hicache.image" -}}
{{- $v := .ctx.Values.image }}
{{- $tag := $v.tag | default .ctx.Chart.AppVersion }}
{{- if and .gpu (not $v.tag) }}{{ $tag = printf "%s-cuda" $tag }}{{ end }}
{{- printf "%s:%s" $v.repository $tag }}
{{- end }}

{{/* Secrets ------------------------------------------------------------------------------------- */}}

{{/* Value of key in the chart's Secret as already installed (empty on first install / offline render). */}}
{{- define "hicache.secret.existing" -}}
{{- $s := lookup "v1" "Secret" .ctx.Release.Namespace (include "hicache.secret.name" .ctx) }}
{{- if and $s $s.data (hasKey $s.data .key) }}{{ index $s.data .key | b64dec }}{{ end }}
{{- end }}

{{/* The bearer token: the value given, the one already installed, else a new random one (once per render). */}}
{{- define "hicache.authToken" -}}
{{- if .Values.auth.token }}{{ .Values.auth.token }}
{{- else }}
{{- $cached := index (.Values.__generated | default dict) "authToken" }}
{{- if $cached }}{{ $cached }}
{{- else }}
{{- $v := include "hicache.secret.existing" (dict "ctx" . "key" "auth-token") | default (randAlphaNum 40) }}
{{- $_ := set .Values "__generated" (merge (dict "authToken" $v) (.Values.__generated | default dict)) }}
{{- $v }}
{{- end }}
{{- end }}
{{- end }}

{{- define "hicache.redisPassword" -}}
{{- if .Values.redis.auth.password }}{{ .Values.redis.auth.password }}
{{- else }}
{{- $cached := index (.Values.__generated | default dict) "redisPassword" }}
{{- if $cached }}{{ $cached }}
{{- else }}
{{- $v := include "hicache.secret.existing" (dict "ctx" . "key" "redis-password") | default (randAlphaNum 32) }}
{{- $_ := set .Values "__generated" (merge (dict "redisPassword" $v) (.Values.__generated | default dict)) }}
{{- $v }}
{{- end }}
{{- end }}
{{- end }}

{{/* Secret name + key holding the auth token / redis password / external storage URL. */}}
{{- define "hicache.authToken.secretName" -}}{{ .Values.auth.existingSecret | default (include "hicache.secret.name" .) }}{{- end }}
{{- define "hicache.authToken.secretKey" -}}{{ ternary .Values.auth.existingSecretKey "auth-token" (ne .Values.auth.existingSecret "") }}{{- end }}
{{- define "hicache.redisPassword.secretName" -}}{{ .Values.redis.auth.existingSecret | default (include "hicache.secret.name" .) }}{{- end }}
{{- define "hicache.redisPassword.secretKey" -}}{{ ternary .Values.redis.auth.existingSecretKey "redis-password" (ne .Values.redis.auth.existingSecret "") }}{{- end }}
{{- define "hicache.storageUrl.secretName" -}}{{ .Values.externalStorage.existingSecret | default (include "hicache.secret.name" .) }}{{- end }}
{{- define "hicache.storageUrl.secretKey" -}}{{ ternary .Values.externalStorage.existingSecretKey "storage-url" (ne .Values.externalStorage.existingSecret "") }}{{- end }}

{{/* Whether the chart's own Secret has anything to hold. */}}
{{- define "hicache.secret.needed" -}}
{{- if or (and .Values.auth.enabled (not .Values.auth.existingSecret)) (and .Values.redis.enabled .Values.redis.auth.enabled (not .Values.redis.auth.existingSecret)) (and (not .Values.redis.enabled) .Values.externalStorage.url (not .Values.externalStorage.existingSecret)) }}true{{ end }}
{{- end }}

{{/* Storage ------------------------------------------------------------------------------------- */}}

{{/* Whether L3 is configured at all. */}}
{{- define "hicache.storage.enabled" -}}
{{- if or .Values.redis.enabled .Values.externalStorage.url .Values.externalStorage.existingSecret }}true{{ end }}
{{- end }}

{{/* host:port list of the bundled Redis (every master for Cluster, the one pod otherwise). */}}
{{- define "hicache.redis.hosts" -}}
{{- $hosts := list }}
{{- if .Values.redis.cluster.enabled }}
{{- range $i := until (int .Values.redis.cluster.masters) }}
{{- $hosts = append $hosts (printf "%s-%d.%s.%s.svc:%d" (include "hicache.redis.name" $) $i (include "hicache.redis.headless" $) $.Release.Namespace (int $.Values.redis.port)) }}
{{- end }}
{{- else }}
{{- $hosts = append $hosts (printf "%s.%s.svc:%d" (include "hicache.redis.name" .) .Release.Namespace (int .Values.redis.port)) }}
{{- end }}
{{- join "," $hosts }}
{{- end }}

{{/* Bundled Redis URL; the password comes from $(HICACHE_REDIS_PASSWORD), expanded by the kubelet. */}}
{{- define "hicache.redis.url" -}}
{{- $scheme := ternary "redis+cluster" "redis" .Values.redis.cluster.enabled }}
{{- $auth := ternary ":$(HICACHE_REDIS_PASSWORD)@" "" .Values.redis.auth.enabled }}
{{- printf "%s://%s%s" $scheme $auth (include "hicache.redis.hosts" .) }}
{{- end }}

{{/* Environment of the node container that carries secrets (never in the ConfigMap). */}}
{{- define "hicache.node.secretEnv" -}}
{{- if .Values.auth.enabled }}
- name: HICACHE_SERVE__AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "hicache.authToken.secretName" . }}
      key: {{ include "hicache.authToken.secretKey" . }}
{{- end }}
{{- if .Values.redis.enabled }}
{{- if .Values.redis.auth.enabled }}
- name: HICACHE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "hicache.redisPassword.secretName" . }}
      key: {{ include "hicache.redisPassword.secretKey" . }}
{{- end }}
- name: HICACHE_STORAGE__URL
  value: {{ include "hicache.redis.url" . | quote }}
{{- else if or .Values.externalStorage.url .Values.externalStorage.existingSecret }}
- name: HICACHE_STORAGE__URL
  valueFrom:
    secretKeyRef:
      name: {{ include "hicache.storageUrl.secretName" . }}
      key: {{ include "hicache.storageUrl.secretKey" . }}
{{- end }}
{{- end }}

{{/* Config -------------------------------------------------------------------------------------- */}}

{{/* hicache.yaml: values.config plus what the chart owns (listen address, ports, device, TLS paths). */}}
{{- define "hicache.config" -}}
{{- $c := deepCopy .Values.config }}
{{- $serve := merge (dict
    "host" "0.0.0.0"
    "port" (int .Values.node.port)
    "metrics_port" (ternary (int .Values.metrics.port) 0 .Values.metrics.enabled)
  ) ($c.serve | default dict) }}
{{- if .Values.tls.enabled }}
{{- $_ := set $serve "tls_cert" "/etc/hicache/tls/tls.crt" }}
{{- $_ := set $serve "tls_key" "/etc/hicache/tls/tls.key" }}
{{- if .Values.tls.mtls }}{{ $_ := set $serve "tls_client_ca" "/etc/hicache/tls/ca.crt" }}{{ end }}
{{- end }}
{{- $_ := set $c "serve" $serve }}
{{- $cache := merge (dict "device" (ternary "cuda" "cpu" .Values.node.gpu.enabled)) ($c.cache | default dict) }}
{{- $_ := set $c "cache" $cache }}
{{- $storage := $c.storage | default dict }}
{{- $_ := set $storage "url" "" }}
{{- $_ := set $c "storage" $storage }}
{{- toYaml $c }}
{{- end }}

{{/* Bytes of the L1 pool: l1 pages x (page_size x heads x head_dim x dtype bytes x K/V x layers). */}}
{{- define "hicache.l1Bytes" -}}
{{- $l := .Values.config.layout }}
{{- $size := dict "bfloat16" 2 "float16" 2 "float32" 4 "float8_e4m3fn" 1 "float8_e5m2" 1 "int8" 1 "uint8" 1 }}
{{- $kv := ternary 1 2 (eq $l.attention "mla") }}
{{- $pages := div (int .Values.config.cache.l1_tokens) (int $l.page_size) }}
{{- mul $pages (int $l.page_size) (int $l.num_kv_heads) (int $l.head_dim) (int (index $size $l.dtype)) $kv (int $l.num_layers) }}
{{- end }}

{{/* /dev/shm size: given, else the CPU L1 pool (it lives there when shared) + 1 GiB, or 1 GiB on GPU nodes. */}}
{{- define "hicache.shmSize" -}}
{{- if .Values.node.shm.sizeLimit }}{{ .Values.node.shm.sizeLimit }}
{{- else }}
{{- $gib := 1073741824 }}
{{- $pool := ternary 0 (int64 (include "hicache.l1Bytes" .)) .Values.node.gpu.enabled }}
{{- printf "%dMi" (div (add $pool $gib 1048575) 1048576) }}
{{- end }}
{{- end }}

{{/* Checks across values that the schema cannot express; fails the render with a message naming the values. */}}
{{- define "hicache.validate" -}}
{{- if and .Values.redis.enabled (or .Values.externalStorage.url .Values.externalStorage.existingSecret) }}
{{- fail "externalStorage is set while redis.enabled=true: pick one L3 store (set redis.enabled=false to use externalStorage)" }}
{{- end }}
{{- $layout := .Values.config.layout | default dict }}
{{- $cache := .Values.config.cache | default dict }}
{{- if lt (int ($cache.l1_tokens | default 65536)) (int ($layout.page_size | default 64)) }}
{{- fail (printf "config.cache.l1_tokens (%v) must be >= config.layout.page_size (%v)" $cache.l1_tokens $layout.page_size) }}
{{- end }}
{{- if and (eq (($layout.attention | default "mha") | toString) "mla") (ne (int ($layout.num_kv_heads | default 8)) 1) }}
{{- fail "config.layout.num_kv_heads must be 1 when config.layout.attention is mla" }}
{{- end }}
{{- $model := .Values.config.model | default dict }}
{{- if ge (int ($model.tp_rank | default 0)) (int ($model.tp_size | default 1)) }}
{{- fail (printf "config.model.tp_rank (%v) must be < config.model.tp_size (%v)" $model.tp_rank $model.tp_size) }}
{{- end }}
{{- if and .Values.metrics.enabled (eq (int .Values.metrics.port) (int .Values.node.port)) }}
{{- fail "metrics.port and node.port must differ" }}
{{- end }}
{{- if lt (int .Values.node.terminationGracePeriodSeconds) (int (.Values.config.serve | default dict).shutdown_grace_s) }}
{{- fail "node.terminationGracePeriodSeconds must be >= config.serve.shutdown_grace_s (SIGTERM flushes L3 writebacks)" }}
{{- end }}
{{- end }}
