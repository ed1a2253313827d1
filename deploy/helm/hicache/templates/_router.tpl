{{/*
The router's command line, in one place: `hicache route --config /etc/hicache/router.yaml` plus the node
list as repeated `--node=NAME=host:port` flags (they replace router.yaml's router.nodes):
  * router.nodes given: exactly those;
  * node.kind=statefulset: every replica by its stable DNS name;
  * node.kind=daemonset: the node pods behind the headless Service, resolved when the router starts
    (it waits up to 5 minutes for the first one); restart the router after adding GPU nodes;
  * node.enabled=false: no hicache node;
and then every entry of engines (`--node=NAME=ADDRESS`; its KV events go into router.yaml).
*/}}
{{- define "hicache.router.nodeFlags" -}}
{{- $flags := list }}
{{- if .Values.router.nodes }}
{{- range .Values.router.nodes }}{{ $flags = append $flags (printf "--node=%s" .) }}{{ end }}
{{- else if and .Values.node.enabled (eq .Values.node.kind "statefulset") }}
{{- range $i := until (int .Values.node.replicas) }}
{{- $pod := printf "%s-%d" (include "hicache.node.name" $) $i }}
{{- $flags = append $flags (printf "--node=%s=%s.%s.%s.svc:%d" $pod $pod (include "hicache.node.headless" $) $.Release.Namespace (int $.Values.node.port)) }}
{{- end }}
{{- end }}
{{- range .Values.engines }}{{ $flags = append $flags (printf "--node=%s=%s" .name .address) }}{{ end }}
{{- toJson $flags }}
{{- end }}

{{/* host, ports and the rest of the router section come from router.yaml (hicache.router.config). */}}
{{- define "hicache.router.args" -}}
{{- $args := list "route" "--config" "/etc/hicache/router.yaml" }}
{{- $args = concat $args (include "hicache.router.nodeFlags" . | fromJsonArray) .Values.router.extraArgs }}
{{- toJson $args }}
{{- end }}

{{/* Container command: plain `hicache ARGS`, or, for a DaemonSet without router.nodes, a small launcher
that resolves the headless Service into --node flags first. */}}
{{- define "hicache.router.discover" -}}
{{- and .Values.node.enabled (not .Values.router.nodes) (eq .Values.node.kind "daemonset") }}
{{- end }}

{{- define "hicache.router.container" -}}
{{- $args := include "hicache.router.args" . | fromJsonArray }}
{{- if eq (include "hicache.router.discover" .) "true" }}
command: ["python3", "-c"]
args:
  - |
    import os, socket, sys, time
    host, port = sys.argv[1], int(sys.argv[2])
    deadline = time.monotonic() + 300
    while True:
        try:
            ips = sorted({a[4][0] for a in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)})
        except socket.gaierror:
            ips = []
        if ips or time.monotonic() > deadline:
            break
        print(f"waiting for node pods behind {host}", flush=True)
        time.sleep(5)
    def flag(ip):
        name = "node-" + ip.replace(".", "-").replace(":", "-")
        return f"--node={name}=[{ip}]:{port}" if ":" in ip else f"--node={name}={ip}:{port}"
    flags = [flag(ip) for ip in ips]
    os.execvp("hicache", ["hicache", *sys.argv[3:], *flags])
  - {{ printf "%s.%s.svc" (include "hicache.node.headless" .) .Release.Namespace | quote }}
  - {{ .Values.node.port | quote }}
  {{- range $args }}
  - {{ . | quote }}
  {{- end }}
{{- else }}
args:
  {{- range $args }}
  - {{ . | quote }}
  {{- end }}
{{- end }}
{{- end }}

{{/* router.yaml: the nodes' model and layout (the router computes the same page keys) + the router section. */}}
{{- define "hicache.router.config" -}}
{{- $c := .Values.config }}
{{- $r := deepCopy (.Values.router.config | default dict) }}
{{- $_ := set $r "host" "0.0.0.0" }}
{{- $_ := set $r "port" (int .Values.router.port) }}
{{- $_ := set $r "metrics_port" (ternary (int .Values.router.metrics.port) 0 .Values.metrics.enabled) }}
{{- if .Values.metrics.enabled }}
{{- /* Prometheus scrapes the pod's address, not the router's loopback default */}}
{{- $_ := set $r "metrics_host" "0.0.0.0" }}
{{- end }}
{{- if .Values.auth.tokensFileSecret }}
{{- $_ := set $r "auth_tokens_file" "/etc/hicache/auth/tokens.yaml" }}
{{- end }}
{{- if .Values.engines }}
{{- $events := $r.kv_events | default dict }}
{{- $replay := $r.kv_events_replay | default dict }}
{{- range .Values.engines }}
{{- $_ := set $events (.name | default "") .kvEvents }}
{{- if .kvEventsReplay }}{{ $_ := set $replay (.name | default "") .kvEventsReplay }}{{ end }}
{{- end }}
{{- $_ := set $r "kv_events" $events }}
{{- $_ := set $r "kv_events_replay" $replay }}
{{- end }}
{{- if .Values.tls.enabled }}
{{- $_ := set $r "node_tls_ca" "/etc/hicache/tls/ca.crt" }}
{{- if .Values.tls.mtls }}
{{- $_ := set $r "node_client_cert" "/etc/hicache/tls/tls.crt" }}
{{- $_ := set $r "node_client_key" "/etc/hicache/tls/tls.key" }}
{{- end }}
{{- end }}
{{- toYaml (dict "model" ($c.model | default dict) "layout" ($c.layout | default dict) "router" $r) }}
{{- end }}
