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

{{/* Component names stay <= 63 characters with their suffixes, a StatefulSet's <= 52: its controller labels
each pod controller-revision-hash=<name>-<hash of up to 10 characters>, a label value (63 at most). */}}
{{- define "hicache.node.name" -}}{{ include "hicache.fullname" . | trunc (ternary 47 50 (eq .Values.node.kind "statefulset")) | trimSuffix "-" }}-node{{- end }}
{{- define "hicache.node.headless" -}}{{ include "hicache.fullname" . | trunc 41 | trimSuffix "-" }}-node-headless{{- end }}
{{- define "hicache.router.name" -}}{{ include "hicache.fullname" . | trunc 48 | trimSuffix "-" }}-router{{- end }}
{{- define "hicache.redis.name" -}}{{ include "hicache.fullname" . | trunc 46 | trimSuffix "-" }}-redis{{- end }}
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

{{/* The /metrics bearer token: as hicache.authToken, under the Secret's key metrics-token. */}}
{{- define "hicache.metricsToken" -}}
{{- if .Values.metrics.auth.token }}{{ .Values.metrics.auth.token }}
{{- else }}
{{- $cached := index (.Values.__generated | default dict) "metricsToken" }}
{{- if $cached }}{{ $cached }}
{{- else }}
{{- $v := include "hicache.secret.existing" (dict "ctx" . "key" "metrics-token") | default (randAlphaNum 40) }}
{{- $_ := set .Values "__generated" (merge (dict "metricsToken" $v) (.Values.__generated | default dict)) }}
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
{{- define "hicache.metricsToken.secretName" -}}{{ .Values.metrics.auth.existingSecret | default (include "hicache.secret.name" .) }}{{- end }}
{{- define "hicache.metricsToken.secretKey" -}}{{ ternary .Values.metrics.auth.existingSecretKey "metrics-token" (ne .Values.metrics.auth.existingSecret "") }}{{- end }}
{{/* Whether the nodes' /metrics wants a bearer token. */}}
{{- define "hicache.metrics.auth" -}}{{ if and .Values.metrics.enabled .Values.metrics.auth.enabled }}true{{ end }}{{- end }}
{{- define "hicache.redisPassword.secretName" -}}{{ .Values.redis.auth.existingSecret | default (include "hicache.secret.name" .) }}{{- end }}
{{- define "hicache.redisPassword.secretKey" -}}{{ ternary .Values.redis.auth.existingSecretKey "redis-password" (ne .Values.redis.auth.existingSecret "") }}{{- end }}
{{- define "hicache.storageUrl.secretName" -}}{{ .Values.externalStorage.existingSecret | default (include "hicache.secret.name" .) }}{{- end }}
{{- define "hicache.storageUrl.secretKey" -}}{{ ternary .Values.externalStorage.existingSecretKey "storage-url" (ne .Values.externalStorage.existingSecret "") }}{{- end }}

{{/* Whether the chart's own Secret has anything to hold. */}}
{{- define "hicache.secret.needed" -}}
{{- if or (and .Values.auth.enabled (not .Values.auth.existingSecret)) (and (include "hicache.metrics.auth" .) (not .Values.metrics.auth.existingSecret)) (and .Values.redis.enabled .Values.redis.auth.enabled (not .Values.redis.auth.existingSecret)) (and (not .Values.redis.enabled) .Values.externalStorage.url (not .Values.externalStorage.existingSecret)) }}true{{ end }}
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
{{- if include "hicache.metrics.auth" . }}
- name: HICACHE_SERVE__METRICS_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "hicache.metricsToken.secretName" . }}
      key: {{ include "hicache.metricsToken.secretKey" . }}
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

{{/* hicache.yaml: values.config plus what the chart owns (listen addresses, ports, device, TLS paths, the
tokens file's path). */}}
{{- define "hicache.config" -}}
{{- $c := deepCopy .Values.config }}
{{- $serve := merge (dict
    "host" "0.0.0.0"
    "port" (int .Values.node.port)
    "metrics_port" (ternary (int .Values.metrics.port) 0 .Values.metrics.enabled)
  ) ($c.serve | default dict) }}
{{- if .Values.metrics.enabled }}
{{- /* Prometheus scrapes the pod's address: hicache's own default, loopback, would serve nobody */}}
{{- $_ := set $serve "metrics_host" "0.0.0.0" }}
{{- if .Values.metrics.tls }}{{ $_ := set $serve "metrics_tls" true }}{{ end }}
{{- end }}
{{- if .Values.auth.tokensFileSecret }}
{{- $_ := set $serve "auth_tokens_file" "/etc/hicache/auth/tokens.yaml" }}
{{- end }}
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
{{- $out := toYaml $c }}
{{- if not $out }}
{{- fail "config: Helm cannot write it as YAML: a string in it holds a character toYaml drops (DEL, a C1 control, U+FFFE or U+FFFF); remove it" }}
{{- end }}
{{- $out }}
{{- end }}

{{/* Sizes in bytes of the node's pools, computed as hicache does (hicache.layout.KVLayout,
hicache.pool.HostPool), as JSON: pageBytes (one page, every layer, K and V or the MLA latent), l1Bytes
(l1_tokens // page_size pages) and l2Bytes (l2_tokens // page_size pages, at least one: the node allocates
one page even with L2 off; a block-first L2 holds whole blocks, a layer-first one is a single block). */}}
{{- define "hicache.poolBytes" -}}
{{- $l := .Values.config.layout | default dict }}
{{- $c := .Values.config.cache | default dict }}
{{- $elem := dict "float32" 4 "float16" 2 "bfloat16" 2 "float8_e4m3fn" 1 "float8_e5m2" 1 "int8" 1 "uint8" 1 }}
{{- $ps := int ($l.page_size | default 64) }}
{{- $piece := mul $ps (int ($l.num_kv_heads | default 8)) (int ($l.head_dim | default 128)) (int (index $elem ($l.dtype | default "bfloat16"))) }}
{{- $kv := ternary 1 2 (eq ($l.attention | default "mha") "mla") }}
{{- $page := mul $piece $kv (int ($l.num_layers | default 32)) }}
{{- $l1pages := div (int ($c.l1_tokens | default 65536)) $ps }}
{{- $l2tokens := ternary $c.l2_tokens 262144 (hasKey $c "l2_tokens") }}
{{- $l2pages := max 1 (div (int $l2tokens) $ps) }}
{{- $block := 1 }}
{{- $hostLayout := $c.host_layout | default "page_first" }}
{{- if eq $hostLayout "layer_first" }}
{{- $block = $l2pages }}
{{- else if eq $hostLayout "block_first" }}
{{- $block = int ($c.host_block_pages | default 0) }}
{{- if not $block }}
{{- /* hicache.pool.default_block_pages: the fewest pages (a power of two, at most 64) whose piece run reaches 64 KiB */}}
{{- $block = 1 }}
{{- range until 6 }}{{ if lt (mul $block $piece) 65536 }}{{ $block = mul $block 2 }}{{ end }}{{ end }}
{{- end }}
{{- end }}
{{- $l2 := mul (div (add $l2pages $block -1) $block) $block $page }}
{{- toJson (dict "pageBytes" $page "l1Bytes" (mul $l1pages $page) "l2Bytes" $l2) }}
{{- end }}

{{/* A Kubernetes quantity ("40Gi", "42949672960", "45G", or a number) in bytes, as a float. */}}
{{- define "hicache.quantityBytes" -}}
{{- if kindIs "string" . }}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" . }}
{{- $unit := dict "" 1.0 "m" 0.001 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18
    "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0
    "Ei" 1152921504606846976.0 }}
{{- mulf (float64 $num) (index $unit (trimPrefix $num .)) }}
{{- else }}
{{- float64 . }}
{{- end }}
{{- end }}

{{/* A duration ("500ms", "15s", "1m", "2h": metrics.serviceMonitor's) in milliseconds. */}}
{{- define "hicache.durationMs" -}}
{{- $num := regexFind "^[0-9]+" . }}
{{- mul (int $num) (index (dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000) (trimPrefix $num .)) }}
{{- end }}

{{/* Bytes as "34.0 GiB". */}}
{{- define "hicache.gib" -}}{{ printf "%.1f GiB" (divf (float64 .) 1073741824.0) }}{{- end }}

{{/* Host memory one node pod needs, as JSON: l2 (pinned host memory), l1 (on CPU nodes, where the L1 pool
is host memory too: /dev/shm when shared), overhead (node.memoryOverhead) and their total, in bytes. */}}
{{- define "hicache.nodeMemory" -}}
{{- $p := include "hicache.poolBytes" . | fromJson }}
{{- $l1 := ternary 0.0 (float64 $p.l1Bytes) .Values.node.gpu.enabled }}
{{- $over := include "hicache.quantityBytes" (.Values.node.memoryOverhead | default "0") | float64 }}
{{- toJson (dict "l2" (float64 $p.l2Bytes) "l1" $l1 "overhead" $over "total" (addf $p.l2Bytes $l1 $over)) }}
{{- end }}

{{/* /dev/shm size: given, else the CPU L1 pool (it lives there when shared) + 1 GiB, or 1 GiB on GPU nodes. */}}
{{- define "hicache.shmSize" -}}
{{- if .Values.node.shm.sizeLimit }}{{ .Values.node.shm.sizeLimit }}
{{- else }}
{{- $gib := 1073741824 }}
{{- $pool := ternary 0 (int64 (include "hicache.poolBytes" . | fromJson).l1Bytes) .Values.node.gpu.enabled }}
{{- printf "%dMi" (div (add $pool $gib 1048575) 1048576) }}
{{- end }}
{{- end }}

{{/* Whether the node shares its L1 pool (config.serve.shared_pool, on unless set false). */}}
{{- define "hicache.sharedPool" -}}
{{- $serve := .Values.config.serve | default dict }}
{{- if or (not (hasKey $serve "shared_pool")) $serve.shared_pool }}true{{ end }}
{{- end }}

{{/* Seconds the node may take to stop after SIGTERM (hicache.service.server.NodeServer.stop): in-flight RPCs
get up to config.serve.shutdown_grace_s (a client's open MatchStream holds it that long), then the L3 flush
gets up to as long again, then the writeback threads up to 10 s each to finish the batch they are writing. */}}
{{- define "hicache.node.stopSeconds" -}}
{{- add (mul 2 (int (ceil (include "hicache.node.grace" .)))) 20 }}
{{- end }}

{{/* config.serve.shutdown_grace_s, hicache's default (30) when not given. */}}
{{- define "hicache.node.grace" -}}
{{- $serve := .Values.config.serve | default dict }}
{{- ternary $serve.shutdown_grace_s 30 (hasKey $serve "shutdown_grace_s") }}
{{- end }}

{{/* Engines -------------------------------------------------------------------------------------- */}}

{{/* A port in 1-65535, as a regular expression (deploy/helm/values_schema.py's NODE_PATTERN). */}}
{{- define "hicache.portPattern" -}}([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5]){{- end }}

{{/* Why a ZeroMQ endpoint is not one the router can connect to ("": it is; hicache.router.config.endpoint_problem). */}}
{{- define "hicache.endpointProblem" -}}
{{- if hasPrefix "tcp://*" . }}'*' binds on the engine's side; connect to the engine's host (tcp://HOST:PORT)
{{- else if not (regexMatch (printf `^(tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):%s|ipc://.+)$` (include "hicache.portPattern" .)) .) -}}
not a ZeroMQ endpoint to connect to (tcp://HOST:PORT, port 1-65535, or ipc://PATH)
{{- end }}
{{- end }}

{{/* The endpoint an engine's publisher binds for the one the router connects to: tcp://*:PORT (ipc:// as is). */}}
{{- define "hicache.engines.bind" -}}
{{- ternary (printf "tcp://*%s" (regexFind ":[0-9]+$" .)) . (hasPrefix "tcp://" .) }}
{{- end }}

{{/* The L3 URL for the engines' storage JSON (NOTES.txt): the bundled Redis by its Service names, the
password as PASSWORD; STORAGE_URL for an external store (its URL is in the Secret). */}}
{{- define "hicache.engines.storageUrl" -}}
{{- if .Values.redis.enabled }}
{{- $scheme := ternary "redis+cluster" "redis" .Values.redis.cluster.enabled }}
{{- printf "%s://%s%s" $scheme (ternary ":PASSWORD@" "" .Values.redis.auth.enabled) (include "hicache.redis.hosts" .) }}
{{- else }}STORAGE_URL{{ end }}
{{- end }}

{{/* Checks across values that the schema cannot express; fails the render with a message naming the values. */}}
{{- define "hicache.validate" -}}
{{- if and (not .Values.node.enabled) (not .Values.engines) (not (and .Values.router.enabled .Values.router.nodes)) }}
{{- fail "node.enabled=false deploys no hicache node: list the SGLang / vLLM servers that share the L3 store in engines (name, address, kvEvents; docs/engines-cluster.md), or the nodes the router routes to in router.nodes" }}
{{- end }}
{{- range $i, $e := .Values.engines }}
{{- $name := $e.name | default "" }}
{{- if not (regexMatch `^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$` $name) }}
{{- fail (printf "engines[%d]: name %q: required, the router's name for the engine: letters, digits, '_', '.', '-' (63 at most, starting with a letter or digit)" $i $name) }}
{{- end }}
{{- if not (regexMatch (printf `^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):%s$` (include "hicache.portPattern" $)) ($e.address | default "")) }}
{{- fail (printf "engines[%d] (%s): address %q: expected HOST:PORT (port 1-65535) of the engine's HTTP server: routed requests go there, and its metrics page gives the router its load" $i $name ($e.address | default "")) }}
{{- end }}
{{- if not $e.kvEvents }}
{{- fail (printf "engines[%d] (%s): kvEvents: required, tcp://HOST:PORT of the engine's KV-event publisher (the endpoint of its --kv-events-config)" $i $name) }}
{{- end }}
{{- range $field := list "kvEvents" "kvEventsReplay" }}
{{- $endpoint := index $e $field | default "" }}
{{- $why := ternary (include "hicache.endpointProblem" $endpoint) "" (ne $endpoint "") }}
{{- if $why }}
{{- fail (printf "engines[%d] (%s): %s %q: %s" $i $name $field $endpoint $why) }}
{{- end }}
{{- end }}
{{- end }}
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
{{- range $k, $_ := ((.Values.config.storage | default dict).options | default dict) }}
{{- /* the names hicache.config treats as credentials (a token, a password, a secret) */}}
{{- if regexMatch "(?i)passw|secret|credential|token($|[^s])" $k }}
{{- fail (printf "config.storage.options.%s looks like a credential, and config goes into the ConfigMap: put it in the storage URL's query instead (externalStorage.url, or externalStorage.existingSecret: kept in a Secret), e.g. redis+sentinel://host:26379/mymaster?%s=..." $k $k) }}
{{- end }}
{{- end }}
{{- $model := .Values.config.model | default dict }}
{{- if ge (int ($model.tp_rank | default 0)) (int ($model.tp_size | default 1)) }}
{{- fail (printf "config.model.tp_rank (%v) must be < config.model.tp_size (%v)" $model.tp_rank $model.tp_size) }}
{{- end }}
{{- if and .Values.metrics.enabled (eq (int .Values.metrics.port) (int .Values.node.port)) }}
{{- fail "metrics.port and node.port must differ" }}
{{- end }}
{{- if and .Values.metrics.enabled .Values.metrics.tls (not .Values.tls.enabled) }}
{{- fail "metrics.tls=true serves the nodes' /metrics with the certificate of tls.secretName: set tls.enabled=true (and tls.secretName) too" }}
{{- end }}
{{- if and .Values.auth.tokensFileSecret (not .Values.auth.enabled) }}
{{- fail "auth.tokensFileSecret maps tokens to tenants on the nodes: set auth.enabled=true too (its token is the router's towards the nodes, an admin token)" }}
{{- end }}
{{- $sm := .Values.metrics.serviceMonitor }}
{{- if and .Values.metrics.enabled $sm.enabled $sm.interval $sm.scrapeTimeout (gt (int (include "hicache.durationMs" $sm.scrapeTimeout)) (int (include "hicache.durationMs" $sm.interval))) }}
{{- fail (printf "metrics.serviceMonitor.scrapeTimeout (%s) must not exceed metrics.serviceMonitor.interval (%s): Prometheus refuses such a scrape config" $sm.scrapeTimeout $sm.interval) }}
{{- end }}
{{- if .Values.router.enabled }}
{{- if and .Values.metrics.enabled (eq (int .Values.router.metrics.port) (int .Values.router.port)) }}
{{- fail "router.metrics.port and router.port must differ (router.metrics.port=0: the router exports no metrics)" }}
{{- end }}
{{- $rc := .Values.router.config | default dict }}
{{- /* hicache.router.config.RouterConfig's defaults where a key is removed */}}
{{- $cooldown := ternary $rc.breaker_cooldown_s 5.0 (hasKey $rc "breaker_cooldown_s") }}
{{- $maxCooldown := ternary $rc.breaker_max_cooldown_s 60.0 (hasKey $rc "breaker_max_cooldown_s") }}
{{- if lt (float64 $maxCooldown) (float64 $cooldown) }}
{{- fail (printf "router.config.breaker_max_cooldown_s (%v) must be at least router.config.breaker_cooldown_s (%v): a node's breaker cooldown doubles from the one up to the other" $maxCooldown $cooldown) }}
{{- end }}
{{- /* hicache.router.config.check_approx_capacity: the approximate index predicts whole pages */}}
{{- $approxTokens := ternary $rc.approx_capacity_tokens 1048576 (hasKey $rc "approx_capacity_tokens") }}
{{- if and (eq (toString ($rc.index | default "events")) "approximate") (lt (int $approxTokens) (int ($layout.page_size | default 64))) }}
{{- fail (printf "router.config.approx_capacity_tokens (%v) holds no page of config.layout.page_size (%v) tokens: the approximate index predicts whole pages" $approxTokens ($layout.page_size | default 64)) }}
{{- end }}
{{- if and .Values.engines (eq (toString ($rc.index | default "events")) "approximate") }}
{{- fail "engines: the router follows their KV events, and router.config.index=approximate follows none: use router.config.index=events" }}
{{- end }}
{{- /* hicache.router.config.check_nodes: each node once, by name and by address */}}
{{- $names := dict }}
{{- $addresses := dict }}
{{- $nodes := .Values.router.nodes | default list }}
{{- range .Values.engines }}{{ $nodes = append $nodes (printf "%s=%s" .name .address) }}{{ end }}
{{- range $nodes }}
{{- $address := regexReplaceAll "^[^=]*=" . "" }}
{{- $name := ternary (regexReplaceAll "=.*$" . "") $address (contains "=" .) }}
{{- if or (hasKey $names $name) (hasKey $addresses (lower $address)) }}
{{- fail (printf "router.nodes / engines: %s names a node already listed (each name and each address once: the router would count that node's pages and requests twice)" .) }}
{{- end }}
{{- $_ := set $names $name true }}
{{- $_ := set $addresses (lower $address) true }}
{{- end }}
{{- end }}
{{- if .Values.node.enabled }}
{{- $stop := int (include "hicache.node.stopSeconds" .) }}
{{- if lt (int .Values.node.terminationGracePeriodSeconds) $stop }}
{{- fail (printf "node.terminationGracePeriodSeconds (%v) must be at least %d: on SIGTERM the node gives in-flight RPCs up to config.serve.shutdown_grace_s (%v s), then the L3 flush up to as long again, then its writeback threads up to 20 s; Kubernetes kills it after terminationGracePeriodSeconds, losing the writebacks not flushed" .Values.node.terminationGracePeriodSeconds $stop (include "hicache.node.grace" .)) }}
{{- end }}
{{- $limit := (.Values.node.resources.limits | default dict).memory }}
{{- if $limit }}
{{- $mem := include "hicache.nodeMemory" . | fromJson }}
{{- if lt (include "hicache.quantityBytes" $limit | float64) $mem.total }}
{{- $l2tokens := ternary (.Values.config.cache | default dict).l2_tokens 262144 (hasKey (.Values.config.cache | default dict) "l2_tokens") }}
{{- fail (printf "node.resources.limits.memory (%v) is below what the node needs: L2 %s (config.cache.l2_tokens=%d)%s + node.memoryOverhead %s = %s. hicache serve refuses to start when L2 does not fit in the container's memory; raise node.resources.limits.memory to at least %.0fGi (and node.resources.requests.memory with it), or lower config.cache.l2_tokens" (ternary $limit (int64 $limit) (kindIs "string" $limit)) (include "hicache.gib" $mem.l2) (int64 $l2tokens) (ternary "" (printf " + L1 %s (a CPU node's L1 pool is host memory)" (include "hicache.gib" $mem.l1)) .Values.node.gpu.enabled) (include "hicache.gib" $mem.overhead) (include "hicache.gib" $mem.total) (ceil (divf $mem.total 1073741824.0))) }}
{{- end }}
{{- end }}
{{- if and (not .Values.node.gpu.enabled) (include "hicache.sharedPool" .) .Values.node.shm.sizeLimit (not .Values.node.shm.hostPath) }}
{{- $l1 := (include "hicache.poolBytes" . | fromJson).l1Bytes }}
{{- if lt (include "hicache.quantityBytes" .Values.node.shm.sizeLimit | float64) (float64 $l1) }}
{{- fail (printf "node.shm.sizeLimit (%s) cannot hold the shared L1 pool (%s, config.cache.l1_tokens=%d): on a CPU node it is a /dev/shm segment, and the node would die of SIGBUS filling it; leave node.shm.sizeLimit empty (the pool + 1 GiB) or make it at least %.0fMi" .Values.node.shm.sizeLimit (include "hicache.gib" $l1) (int64 ((.Values.config.cache | default dict).l1_tokens | default 65536)) (ceil (divf $l1 1048576.0))) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* A ServiceMonitor endpoint's bearer token: the nodes' metrics token from its Secret. */}}
{{- define "hicache.serviceMonitor.authorization" -}}
authorization:
  type: Bearer
  credentials:
    name: {{ include "hicache.metricsToken.secretName" . }}
    key: {{ include "hicache.metricsToken.secretKey" . }}
{{- end }}
