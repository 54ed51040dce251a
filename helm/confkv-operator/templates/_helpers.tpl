{{/*
Chart name, truncated to 63 characters (the DNS label limit for names and label values).
*/}}
{{- define "confkv-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name: <release>-<chart> unless the release name already contains the chart name.
*/}}
{{- define "confkv-operator.fullname" -}}
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
Chart name and version, as used by the helm.sh/chart label.
*/}}
{{- define "confkv-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels.
*/}}
{{- define "confkv-operator.labels" -}}
helm.sh/chart: {{ include "confkv-operator.chart" . }}
{{ include "confkv-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: confkv
{{- end }}

{{/*
Selector labels (immutable on a Deployment: never add to them).
*/}}
{{- define "confkv-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "confkv-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Name of the ServiceAccount the operator runs as.
*/}}
{{- define "confkv-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "confkv-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Operator image reference; the tag defaults to the chart's appVersion.
*/}}
{{- define "confkv-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
Engine + agent image the operator puts into ConfKVDeployment pods.
*/}}
{{- define "confkv-operator.engineImage" -}}
{{- default (printf "ghcr.io/confkv/confkv:%s" .Chart.AppVersion) .Values.operator.engineImage }}
{{- end }}

{{/*
The engine image of pods with a GPU (the CUDA build).
*/}}
{{- define "confkv-operator.engineCudaImage" -}}
{{- default (printf "ghcr.io/confkv/confkv:%s-cuda" .Chart.AppVersion) .Values.operator.engineCudaImage }}
{{- end }}

{{/*
operator.monitoringLabels as the operator's CONFKV_MONITORING_LABELS (k=v,k=v, sorted by key).
*/}}
{{- define "confkv-operator.monitoringLabels" -}}
{{- $pairs := list }}
{{- range $key, $value := .Values.operator.monitoringLabels }}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{/*
True (non-empty) when Kopf peering is needed, i.e. more than one operator replica.
*/}}
{{- define "confkv-operator.peeringEnabled" -}}
{{- if gt (int .Values.replicaCount) 1 }}true{{- end }}
{{- end }}

{{/*
True (non-empty) for the namespaced install: a Role in the release namespace, which is all it watches.
*/}}
{{- define "confkv-operator.namespaced" -}}
{{- if eq .Values.scope "namespace" }}true{{- end }}
{{- end }}

{{/*
Namespaces the operator watches, comma-separated (empty: all of them).
*/}}
{{- define "confkv-operator.watchNamespaces" -}}
{{- if include "confkv-operator.namespaced" . }}{{ .Release.Namespace }}{{ else }}{{ .Values.operator.watchNamespaces | join "," }}{{ end }}
{{- end }}

{{/*
Operator settings as environment variables (operator/confkv_operator/settings.py validates them at
start-up). CONFKV_PEERING_PRIORITY is set by the container command when peering is enabled.
*/}}
{{- define "confkv-operator.env" -}}
- name: CONFKV_NAMESPACES
  value: {{ include "confkv-operator.watchNamespaces" . | quote }}
- name: CONFKV_WATCH_SCOPE
  value: {{ .Values.scope | quote }}
- name: CONFKV_HOST_PATH_PREFIXES
  value: {{ .Values.operator.hostPathPrefixes | join "," | quote }}
- name: CONFKV_ENGINE_IMAGE
  value: {{ include "confkv-operator.engineImage" . | quote }}
- name: CONFKV_ENGINE_CUDA_IMAGE
  value: {{ include "confkv-operator.engineCudaImage" . | quote }}
- name: CONFKV_AGENT_IMAGE
  value: {{ .Values.operator.agentImage | quote }}
- name: CONFKV_MONITORING_LABELS
  value: {{ include "confkv-operator.monitoringLabels" . | quote }}
- name: CONFKV_AGENT_PORT
  value: {{ .Values.operator.agentPort | quote }}
- name: CONFKV_LOG_LEVEL
  value: {{ .Values.operator.logLevel | quote }}
- name: CONFKV_RESYNC_SECONDS
  value: {{ .Values.operator.resyncIntervalSeconds | quote }}
- name: CONFKV_LIVENESS_PORT
  value: {{ .Values.operator.livenessPort | quote }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- if include "confkv-operator.peeringEnabled" . }}
- name: CONFKV_PEERING_NAME
  value: {{ .Values.peering.name | quote }}
- name: CONFKV_PEERING_BASE_PRIORITY
  value: {{ .Values.peering.basePriority | quote }}
{{- end }}
{{- end }}
