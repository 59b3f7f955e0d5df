{{/* Labels every object carries. */}}
{{- define "gpusched.labels" -}}
app.kubernetes.io/part-of: gpusched
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "gpusched.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The Secret with the NATS servers' certificate and the CA (cert-manager's or provided). */}}
{{- define "gpusched.tlsSecret" -}}
{{- if .Values.tls.certManager.enabled }}gpusched-nats-tls{{ else }}{{ .Values.tls.secretName }}{{ end }}
{{- end }}

{{/* The CA's key in that Secret: cert-manager names it ca.crt, make-secrets.sh ca.pem. */}}
{{- define "gpusched.caKey" -}}
{{- if .Values.tls.certManager.enabled }}ca.crt{{ else }}ca.pem{{ end }}
{{- end }}

{{/* The pod security context of the unprivileged services. */}}
{{- define "gpusched.podSecurity" -}}
securityContext: {runAsNonRoot: true, runAsUser: 10001, runAsGroup: 10001, fsGroup: 10001, seccompProfile: {type: RuntimeDefault}}
{{- end }}

{{/* A control-plane container's shared part: env, probes, security, mounts. $ = root, .name = service */}}
{{- define "gpusched.serviceContainer" -}}
envFrom: [{configMapRef: {name: gpusched-env}}]
livenessProbe: {httpGet: {path: /healthz, port: health}, periodSeconds: 10, timeoutSeconds: 7, failureThreshold: 3}
readinessProbe: {httpGet: {path: /readyz, port: health}, periodSeconds: 5, timeoutSeconds: 3, failureThreshold: 2}
securityContext: {allowPrivilegeEscalation: false, readOnlyRootFilesystem: true, capabilities: {drop: [ALL]}}
volumeMounts:
  - {name: creds, mountPath: /etc/gpusched/creds, readOnly: true}
  - {name: tls, mountPath: /etc/gpusched/tls, readOnly: true}
  - {name: tmp, mountPath: /tmp}
{{- end }}

{{- define "gpusched.serviceVolumes" -}}
- {name: creds, secret: {secretName: gpusched-creds, defaultMode: 0440, items: [{key: {{ .run }}.nk, path: {{ .run }}.nk}, {key: {{ .run }}.json, path: {{ .run }}.json}]}}
- {name: tls, secret: {secretName: {{ include "gpusched.tlsSecret" .root }}, items: [{key: {{ include "gpusched.caKey" .root }}, path: ca.pem}]}}
- {name: tmp, emptyDir: {}}
{{- end }}

{{- define "gpusched.redisEnv" -}}
- {name: REDIS_PASSWORD, valueFrom: {secretKeyRef: {name: gpusched-redis, key: password}}}
{{- if .Values.redis.sentinel.enabled }}
- {name: GPUSCHED_REDIS_URL, value: "redis+sentinel://:$(REDIS_PASSWORD)@redis-sentinel:26379/gpusched/0"}
{{- else }}
- {name: GPUSCHED_REDIS_URL, value: "redis://:$(REDIS_PASSWORD)@redis:6379/0"}
{{- end }}
{{- end }}

{{/* A label selector from a matchLabels map: k=v,k2=v2 (sorted, as Go ranges maps). */}}
{{- define "gpusched.selector" -}}
{{- $pairs := list }}{{ range $k, $v := . }}{{ $pairs = append $pairs (printf "%s=%s" $k $v) }}{{ end }}{{ join "," $pairs }}
{{- end }}

{{/* The NATS servers' DNS names: the client Service and each pod (routes). */}}
{{- define "gpusched.natsHosts" -}}
{{- $hosts := list "nats" (printf "nats.%s.svc" .Release.Namespace) }}{{ range $i := until (int .Values.nats.replicas) }}{{ $hosts = append $hosts (printf "nats-%d.nats" $i) }}{{ end }}{{ join "," $hosts }}
{{- end }}
