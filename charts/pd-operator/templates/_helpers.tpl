{{- define "pd-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "pd-operator.labels" -}}
app.kubernetes.io/name: pd-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pd-operator.selector" -}}
app.kubernetes.io/name: pd-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pd-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}{{ default (include "pd-operator.fullname" .) .Values.serviceAccount.name }}
{{- else -}}{{ default "default" .Values.serviceAccount.name }}{{- end -}}
{{- end -}}

{{- /* the gateway's image: the value, or the operator's repository renamed pd-gateway, same tag */ -}}
{{- define "pd-operator.gatewayImage" -}}
{{- if .Values.gateway.image -}}{{ .Values.gateway.image }}
{{- else -}}{{ trimSuffix "pd-operator" .Values.image.repository }}pd-gateway:{{ .Values.image.tag }}{{- end -}}
{{- end -}}
