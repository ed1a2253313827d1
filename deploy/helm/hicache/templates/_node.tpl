{{/* Probe handler for the node gRPC port: Kubernetes' grpc.health.v1 probe, tcpSocket under TLS. */}}
{{- define "hicache.node.probeHandler" -}}
{{- if .ctx.Values.tls.enabled }}
tcpSocket:
  port: grpc
{{- else }}
grpc:
  port: {{ .ctx.Values.node.port }}
  service: {{ .service | quote }}
{{- end }}
{{- end }}

{{/* The node pod template, shared by the DaemonSet and the StatefulSet. */}}
{{- define "hicache.node.podTemplate" -}}
{{- $n := .Values.node -}}
metadata:
  labels:
    {{- include "hicache.labels" . | nindent 4 }}
    app.kubernetes.io/component: node
    {{- with $n.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include "hicache.config" . | sha256sum }}
    {{- if and .Values.metrics.enabled .Values.metrics.annotations }}
    prometheus.io/scrape: "true"
    prometheus.io/port: {{ .Values.metrics.port | quote }}
    prometheus.io/path: /metrics
    {{- if .Values.metrics.tls }}
    prometheus.io/scheme: https
    {{- end }}
    {{- end }}
    {{- with $n.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "hicache.serviceAccountName" . }}
  automountServiceAccountToken: {{ .Values.serviceAccount.automountToken }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $n.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $n.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  hostIPC: {{ $n.hostIPC }}
  terminationGracePeriodSeconds: {{ $n.terminationGracePeriodSeconds }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  {{- with $n.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $n.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $n.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: node
      image: {{ include "hicache.image" (dict "ctx" . "gpu" $n.gpu.enabled) }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args: ["serve", "--config", "/etc/hicache/hicache.yaml"]
      ports:
        - name: grpc
          containerPort: {{ $n.port }}
          protocol: TCP
        {{- if .Values.metrics.enabled }}
        - name: metrics
          containerPort: {{ .Values.metrics.port }}
          protocol: TCP
        {{- end }}
      env:
        - name: HOME
          value: /tmp
        - name: CUPY_CACHE_DIR
          value: /tmp/cupy
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        - name: NODE_NAME
          valueFrom:
            fieldRef:
              fieldPath: spec.nodeName
        {{- with include "hicache.node.secretEnv" . | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with $n.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      startupProbe:
        {{- include "hicache.node.probeHandler" (dict "ctx" . "service" "") | trim | nindent 8 }}
        {{- toYaml $n.startupProbe | nindent 8 }}
      livenessProbe:
        {{- include "hicache.node.probeHandler" (dict "ctx" . "service" "") | trim | nindent 8 }}
        {{- toYaml $n.livenessProbe | nindent 8 }}
      readinessProbe:
        {{- include "hicache.node.probeHandler" (dict "ctx" . "service" "hicache.v1.HiCache") | trim | nindent 8 }}
        {{- toYaml $n.readinessProbe | nindent 8 }}
      resources:
        {{- $res := deepCopy $n.resources }}
        {{- if $n.gpu.enabled }}
        {{- $_ := set $res "limits" (merge (dict $n.gpu.resourceName (int $n.gpu.count)) ($res.limits | default dict)) }}
        {{- $_ := set $res "requests" (merge (dict $n.gpu.resourceName (int $n.gpu.count)) ($res.requests | default dict)) }}
        {{- end }}
        {{- toYaml $res | nindent 8 }}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      volumeMounts:
        - name: config
          mountPath: /etc/hicache/hicache.yaml
          subPath: hicache.yaml
          readOnly: true
        - name: tmp
          mountPath: /tmp
        - name: dshm
          mountPath: /dev/shm
        {{- if .Values.tls.enabled }}
        - name: tls
          mountPath: /etc/hicache/tls
          readOnly: true
        {{- end }}
        {{- if .Values.auth.tokensFileSecret }}
        - name: auth-tokens
          mountPath: /etc/hicache/auth
          readOnly: true
        {{- end }}
        {{- with $n.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: config
      configMap:
        name: {{ include "hicache.config.name" . }}
    - name: tmp
      emptyDir: {}
    - name: dshm
      {{- if $n.shm.hostPath }}
      hostPath:
        path: {{ $n.shm.hostPath }}
        type: Directory
      {{- else }}
      emptyDir:
        medium: Memory
        sizeLimit: {{ include "hicache.shmSize" . }}
      {{- end }}
    {{- if .Values.tls.enabled }}
    - name: tls
      secret:
        secretName: {{ .Values.tls.secretName }}
    {{- end }}
    {{- if .Values.auth.tokensFileSecret }}
    - name: auth-tokens
      secret:
        secretName: {{ .Values.auth.tokensFileSecret }}
        items:
          - key: {{ .Values.auth.tokensFileKey }}
            path: tokens.yaml
    {{- end }}
    {{- with $n.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}
