{{/*
Chart name, truncated to the 63 characters a DNS label allows.
*/}}
{{- define "tiered-router.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name: release-chart, or the release name when it already holds the chart name.
*/}}
{{- define "tiered-router.fullname" -}}
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

{{/*
Chart name and version for the helm.sh/chart label.
*/}}
{{- define "tiered-router.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Standard labels on every object.
*/}}
{{- define "tiered-router.labels" -}}
helm.sh/chart: {{ include "tiered-router.chart" . }}
{{ include "tiered-router.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tiered-router
{{- end }}

{{/*
Selector labels of the router pods.
*/}}
{{- define "tiered-router.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tiered-router.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end }}

{{/*
ServiceAccount name.
*/}}
{{- define "tiered-router.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tiered-router.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Container image reference; the tag defaults to the chart's appVersion.
*/}}
{{- define "tiered-router.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) }}
{{- end }}

{{/*
Fixed paths inside the container: the service and the policy's api_keys_file rely on them.
*/}}
{{- define "tiered-router.policyDir" -}}/etc/tiered-router/policy{{- end }}
{{- define "tiered-router.policyPath" -}}/etc/tiered-router/policy/policy.yaml{{- end }}
{{- define "tiered-router.keysDir" -}}/etc/tiered-router/keys{{- end }}
{{- define "tiered-router.adminKeysDir" -}}/etc/tiered-router/admin-keys{{- end }}

{{/*
Name of the ConfigMap holding policy.yaml.
*/}}
{{- define "tiered-router.policyConfigMapName" -}}
{{- if .Values.existingPolicyConfigMap }}
{{- .Values.existingPolicyConfigMap }}
{{- else }}
{{- printf "%s-policy" (include "tiered-router.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/*
The policy text (`policy` is a YAML string, kept byte for byte).
*/}}
{{- define "tiered-router.policyText" -}}
{{- .Values.policy | default "" | toString }}
{{- end }}

{{/*
The policy parsed (as YAML, for `fromYaml` at the call site). Fails the render when the policy
is missing, is not YAML, or lacks `tiers` / `routing`: the service would refuse to start. Full
validation is the service's own (`tiered-router policy check FILE`). Empty when an existing
ConfigMap supplies the policy.
*/}}
{{- define "tiered-router.policyParsed" -}}
{{- if not .Values.existingPolicyConfigMap }}
{{- $text := include "tiered-router.policyText" . }}
{{- if not (trim $text) }}
{{- fail "values: `policy` is empty; set it (e.g. --set-file policy=policies/examples/gpu-qwen.yaml) or set existingPolicyConfigMap" }}
{{- end }}
{{- $p := fromYaml $text }}
{{- if hasKey $p "Error" }}
{{- fail (printf "values: `policy` is not valid YAML: %s" (get $p "Error")) }}
{{- end }}
{{- if not (and (hasKey $p "tiers") (hasKey $p "routing")) }}
{{- fail "values: `policy` must be a mapping with `tiers` and `routing`" }}
{{- end }}
{{- toYaml $p }}
{{- end }}
{{- end }}

{{/*
Drain seconds: the larger of drainTimeoutSeconds and the policy's service.drain_timeout_s
(the service's default, 30, when unset), rounded up.
*/}}
{{- define "tiered-router.drainSeconds" -}}
{{- $drain := float64 .Values.drainTimeoutSeconds }}
{{- if not .Values.existingPolicyConfigMap }}
{{- $p := fromYaml (include "tiered-router.policyParsed" .) }}
{{- $svc := get $p "service" }}
{{- $policyDrain := 30.0 }}
{{- if and (kindIs "map" $svc) (hasKey $svc "drain_timeout_s") }}
{{- $policyDrain = float64 (get $svc "drain_timeout_s") }}
{{- end }}
{{- $drain = maxf $drain $policyDrain }}
{{- end }}
{{- ceil $drain | int }}
{{- end }}

{{/*
terminationGracePeriodSeconds: computed as preStop + drain + margin, or the user's value, which
must leave room for preStop + drain (else the kubelet SIGKILLs generations mid-stream).
*/}}
{{- define "tiered-router.terminationGracePeriodSeconds" -}}
{{- $preStop := int .Values.preStopSleepSeconds }}
{{- $drain := int (include "tiered-router.drainSeconds" .) }}
{{- $minimum := add $preStop $drain }}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add $minimum (int .Values.terminationGraceMarginSeconds) }}
{{- else }}
{{- $set := int .Values.terminationGracePeriodSeconds }}
{{- if lt $set $minimum }}
{{- fail (printf "values: terminationGracePeriodSeconds (%d) must be >= preStopSleepSeconds (%d) + drain (%d s, the larger of drainTimeoutSeconds and the policy's service.drain_timeout_s) = %d" $set $preStop $drain $minimum) }}
{{- end }}
{{- $set }}
{{- end }}
{{- end }}

{{/*
Bundled Jaeger object name.
*/}}
{{- define "tiered-router.jaegerName" -}}
{{- printf "%s-jaeger" (include "tiered-router.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
OTLP endpoint: otel.endpoint, else the bundled Jaeger (when enabled), else empty (tracing off).
*/}}
{{- define "tiered-router.otelEndpoint" -}}
{{- if .Values.otel.endpoint }}
{{- .Values.otel.endpoint }}
{{- else if .Values.jaeger.enabled }}
{{- $port := ternary 4317 4318 (eq .Values.otel.protocol "grpc") }}
{{- printf "http://%s.%s.svc:%d" (include "tiered-router.jaegerName" .) .Release.Namespace $port }}
{{- end }}
{{- end }}

{{/*
Environment variable the service reads the Redis URL from (the policy's
service.cache.redis_url_env, REDIS_URL by default).
*/}}
{{- define "tiered-router.redisEnvName" -}}
{{- $name := "REDIS_URL" }}
{{- if not .Values.existingPolicyConfigMap }}
{{- $p := fromYaml (include "tiered-router.policyParsed" .) }}
{{- $svc := get $p "service" }}
{{- if kindIs "map" $svc }}
{{- $cache := get $svc "cache" }}
{{- if and (kindIs "map" $cache) (get $cache "redis_url_env") }}
{{- $name = get $cache "redis_url_env" }}
{{- end }}
{{- end }}
{{- end }}
{{- $name }}
{{- end }}
