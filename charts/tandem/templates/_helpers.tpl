{{/*
Names. The release's base name is the release name, or "<release>-tandem" when the release name
does not contain "tandem"; the operator's objects are "<base>-operator" (release "tandem" →
"tandem-operator", the ServiceAccount the docs and tests name).
*/}}
{{- define "tandem.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 54 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 54 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tandem.operatorName" -}}
{{- printf "%s-operator" (include "tandem.fullname" .) -}}
{{- end -}}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels: stable across upgrades (a Deployment selector is immutable). */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: tandem-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tandem.labels" -}}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: tandem
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ include "tandem.chart" . }}
{{- end -}}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Guards that the schema cannot express. */}}
{{- define "tandem.validate" -}}
{{- if and (gt (int .Values.replicas) 1) (not .Values.leaderElection.enabled) -}}
{{- fail "replicas > 1 needs leaderElection.enabled=true: two operators without a Lease would both reconcile" -}}
{{- end -}}
{{- end -}}
